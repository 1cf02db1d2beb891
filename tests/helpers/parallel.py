"""What the parallel tests share: a small SmolLM2 config at tp ranks and prompts behind a
shared prefix; checks that greedy tokens equal world size 1 with prefix caching and
preemption, and a worker killed mid-generation failing every waiter with no process left."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable

import pytest

from agentx import (
    CacheConfig,
    Engine,
    EngineConfig,
    EngineDeadError,
    ParallelConfig,
    SamplingParams,
    SchedulerConfig,
)

NUM_BLOCKS = 12
PROMPTS = ["The quick brown fox", "My favourite food is", "import numpy as np\n"]


def tp_config(tp: int, **kw) -> EngineConfig:
    """SmolLM2 at ``tp`` ranks (or another model: ``model=``), small enough to preempt."""
    # 11 usable blocks: three ~100-token requests sharing 4 prefix blocks fill it, a fourth preempts
    return EngineConfig(
        cache=CacheConfig(num_blocks=kw.pop("num_blocks", NUM_BLOCKS), block_size=16),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=32, long_prefill_token_threshold=16, step_cost_model="fixed"
        ),
        parallel=ParallelConfig(tp=tp),
        **kw,
    )


def long_prompts(engine: Engine, texts: list[str] = PROMPTS) -> list[list[int]]:
    """Each text behind a shared 72-token prefix (4 full blocks of 16)."""
    tok = engine.tokenizer
    shared = tok.encode("You are a careful assistant. " * 12)  # 72 tokens: 4 full blocks
    return [shared + tok.encode(p) for p in texts]


def wait_for_tokens(stream) -> None:
    """Until a few tokens arrived: the kill lands mid-generation."""
    received = 0
    while received < 3:
        received += len(stream.get(timeout=120).new_token_ids)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive (but it was reaped: gone)
        return f.read().split()[2] != "Z"


def assert_no_process_left(pids: list[int]) -> None:
    assert all(not alive(pid) for pid in pids)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]


def check_greedy_cached_and_preempted(
    one: Engine, many: Engine, prompts: Callable[[int], list[list[int]]], greedy: SamplingParams
) -> None:
    """``many`` (world size > 1) gives ``one``'s tokens on 3 prompts, again from the prefix cache
    (>= 64 shared tokens), and on 4 prompts that do not fit its pool at once (preemption)."""
    want = [g.token_ids for g in one.generate(prompts(3), greedy)]
    assert [g.token_ids for g in many.generate(prompts(3), greedy)] == want
    again = many.generate(prompts(3), greedy)  # the shared prefix from the cache
    assert [g.token_ids for g in again] == want
    assert min(g.usage.cached_tokens for g in again) >= 64
    want = [g.token_ids for g in one.generate(prompts(4), greedy)]
    before = many.stats().num_preemptions
    assert [g.token_ids for g in many.generate(prompts(4), greedy)] == want
    assert many.stats().num_preemptions > before
    assert many.stats().kv_num_used_blocks == 0
    many.check_integrity()


def kill_rank_mid_generation(
    engine: Engine, rank: int, prompt: list[int], max_tokens: int, again: SamplingParams
) -> list[int]:
    """SIGKILL ``rank``'s worker while ``prompt`` generates: the stream and the next request
    fail with EngineDeadError. Returns the workers' pids."""
    pids = engine.core.runner.pids
    stream = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    wait_for_tokens(stream)
    os.kill(pids[rank], signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        stream.result(timeout=120)
    with pytest.raises(EngineDeadError):
        engine.add_request(prompt, again)
    return pids
