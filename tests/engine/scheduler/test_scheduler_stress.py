"""Randomised workloads against the scheduler and KV manager with invariants checked after every
step: shared prefixes, preemption, aborts, chunking. Seeded, so every run is the same."""

import random
import zlib

import pytest

from agentx.config import SchedulerConfig
from agentx.engine.outputs import ModelRunnerOutput
from agentx.engine.request import RequestStatus
from agentx.engine.scheduler import Scheduler
from tests.helpers.kv import make_manager, make_request


def token_for(request_id: str, index: int) -> int:
    """A deterministic 'model': the next token depends only on the request and position (crc32,
    not ``hash()``: str hashes change with PYTHONHASHSEED)."""
    return (zlib.crc32(request_id.encode()) + 7 * index) % 50 + 1000


def step(s: Scheduler, cfg: SchedulerConfig, outputs: dict[str, list[int]]) -> None:
    """One step with the fake model, checking the budget, the cap and every invariant."""
    out = s.schedule()
    assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
    if cfg.long_prefill_token_threshold:
        assert all(len(x.token_ids) <= cfg.long_prefill_token_threshold for x in out.scheduled)
    sampled = {
        x.request_id: token_for(x.request_id, x.num_output_tokens)
        for x in out.scheduled
        if x.sample
    }
    for delta in s.update_from_output(out, ModelRunnerOutput(sampled)):
        outputs[delta.request_id] += delta.new_token_ids
    s.check_integrity()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workload_keeps_invariants_and_outputs(seed, policy):
    rng = random.Random(seed)
    kv = make_manager(num_blocks=rng.choice([8, 10, 16]))
    cfg = SchedulerConfig(
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_num_seqs=rng.choice([2, 4, 8]),
        long_prefill_token_threshold=rng.choice([0, 4, 8]),
        prefill_schedule_interval=rng.choice([1, 2]),
        policy=policy,
        cold_prefill_tokens=rng.choice([0, 4, 12]),  # first-turn lanes off or on
    )
    s = Scheduler(cfg, kv, max_model_len=64)
    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    outputs: dict[str, list[int]] = {}
    expected_len: dict[str, int] = {}
    aborted: set[str] = set()
    next_id = 0
    for _ in range(300):
        if rng.random() < 0.3 and next_id < 40:
            rid = f"r{next_id}"
            next_id += 1
            prompt = rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randrange(1, 8))]
            max_tokens = rng.randrange(1, 10)
            s.add_request(
                make_request(rid, prompt, max_tokens=max_tokens, priority=rng.randrange(3))
            )
            outputs[rid] = []
            expected_len[rid] = max_tokens
        if rng.random() < 0.05 and s.requests:
            rid = rng.choice(sorted(s.requests))
            s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            aborted.add(rid)
        step(s, cfg, outputs)
    while s.has_unfinished_requests():
        step(s, cfg, outputs)
    assert kv.get_num_used_blocks() == 0
    for rid, tokens in outputs.items():
        if rid in aborted:
            continue
        # preemption and chunking never change what a request generates
        assert tokens == [token_for(rid, i) for i in range(expected_len[rid])], rid
