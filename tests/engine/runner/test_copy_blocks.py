"""ModelRunner.copy_blocks: whole blocks (every slot's page) copied for partial prefix hits and
copy-on-write forks, every source read before any destination is written."""

from types import SimpleNamespace

import torch

from agentx.engine.kv_cache import BlockCopy
from agentx.engine.runner.model_runner import ModelRunner


def _runner(num_slots: int = 2, num_blocks: int = 6, page: int = 40) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(num_blocks)
    slots = [
        torch.randint(0, 256, (num_blocks, page), dtype=torch.uint8, generator=gen)
        for _ in range(num_slots)
    ]
    return SimpleNamespace(kv_slots=slots, device=torch.device("cpu"))


def test_disjoint_copies_copy_each_block_in_every_slot():
    runner = _runner()
    before = [slot.clone() for slot in runner.kv_slots]
    ModelRunner.copy_blocks(runner, [BlockCopy(1, 4), BlockCopy(2, 5)])
    for slot, old in zip(runner.kv_slots, before, strict=True):
        assert torch.equal(slot[4], old[1]) and torch.equal(slot[5], old[2])
        assert torch.equal(slot[:4], old[:4])  # the sources and the rest untouched


def test_a_block_both_read_and_written_is_read_first():
    runner = _runner()
    before = [slot.clone() for slot in runner.kv_slots]
    # block 2 is a destination and a source: the second copy takes 2's old bytes
    ModelRunner.copy_blocks(runner, [BlockCopy(1, 2), BlockCopy(2, 3)])
    for slot, old in zip(runner.kv_slots, before, strict=True):
        assert torch.equal(slot[2], old[1]) and torch.equal(slot[3], old[2])
        assert torch.equal(slot[4:], old[4:]) and torch.equal(slot[:2], old[:2])


def test_no_copies_touch_nothing():
    runner = _runner()
    before = [slot.clone() for slot in runner.kv_slots]
    ModelRunner.copy_blocks(runner, [])
    assert all(torch.equal(a, b) for a, b in zip(runner.kv_slots, before, strict=True))
