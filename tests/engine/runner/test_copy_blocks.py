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


def _copied(copies: list[BlockCopy]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each slot after ``copies``, beside its bytes before."""
    runner = _runner()
    before = [slot.clone() for slot in runner.kv_slots]
    ModelRunner.copy_blocks(runner, copies)
    return list(zip(runner.kv_slots, before, strict=True))


def test_disjoint_copies_copy_each_block_in_every_slot():
    for slot, old in _copied([BlockCopy(1, 4), BlockCopy(2, 5)]):
        assert torch.equal(slot[4], old[1]) and torch.equal(slot[5], old[2])
        assert torch.equal(slot[:4], old[:4])  # the sources and the rest untouched


def test_a_block_both_read_and_written_is_read_first():
    # block 2 is a destination and a source: the second copy takes 2's old bytes
    for slot, old in _copied([BlockCopy(1, 2), BlockCopy(2, 3)]):
        assert torch.equal(slot[2], old[1]) and torch.equal(slot[3], old[2])
        assert torch.equal(slot[4:], old[4:]) and torch.equal(slot[:2], old[:2])


def test_no_copies_touch_nothing():
    assert all(torch.equal(slot, old) for slot, old in _copied([]))
