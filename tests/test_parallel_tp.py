"""Tensor parallel over worker processes (gloo on loopback, world size 2).

Greedy tokens at tp=2 equal tp=1 on SmolLM2 with prefix caching, chunked prefill and
preemption on; a tiny random Llama checks KV heads replicated over ranks; a worker killed
mid-step fails every waiter with EngineDeadError and leaves no process behind.

Why a chosen prompt, not every prompt: at tp=1 SmolLM2's layers run as one fused op, which a
tensor-parallel rank cannot (its o_proj and down_proj all-reduce between the projections), so
tp=2 runs the same quantized kernels op by op and sums the two ranks' partial o_proj / down_proj
outputs: the float additions happen in another order. On "def fibonacci(n):\\n" the top two
first tokens are that close and the paths pick different ones (tp=1 op by op, on one rank, picks
what tp=2 picks); the prompts below keep their greedy tokens across the paths.
"""

import multiprocessing
import os
import signal

import pytest
import torch
import transformers
from model_helpers import save_hf_folder, tiny_hf_config

from agentx import (
    CacheConfig,
    Engine,
    EngineConfig,
    EngineDeadError,
    ParallelConfig,
    SamplingParams,
    SchedulerConfig,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["The capital of France is", "List three primary colors:\n1."]


def _config(tp: int, **kw) -> EngineConfig:
    # a 40-block pool for three 24-token outputs at 16-token chunks: the third request preempts
    return EngineConfig(
        cache=CacheConfig(num_blocks=kw.pop("num_blocks", 40), block_size=16),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=32, long_prefill_token_threshold=16, step_cost_model="fixed"
        ),
        parallel=ParallelConfig(tp=tp),
        **kw,
    )


@pytest.fixture(scope="module")
def engines():
    tp2 = Engine(_config(2))
    tp1 = Engine(_config(1))
    yield tp1, tp2
    tp1.close()
    tp2.close()


def _long_prompts(engine: Engine) -> list[list[int]]:
    tok = engine.tokenizer
    shared = tok.encode("You are a careful assistant. " * 12)  # ~80 tokens: 5 shared blocks
    return [shared + tok.encode(p) for p in PROMPTS]


def test_tp2_greedy_equals_tp1(engines):
    tp1, tp2 = engines
    prompts = _long_prompts(tp1)
    want = [g.token_ids for g in tp1.generate(prompts, GREEDY)]
    got = [g.token_ids for g in tp2.generate(prompts, GREEDY)]
    assert got == want
    # again: the shared prefix and each prompt now hit the prefix cache
    again = tp2.generate(prompts, GREEDY)
    assert [g.token_ids for g in again] == want
    assert all(g.usage.cached_tokens >= 80 for g in again)
    tp2.check_integrity()


def test_tp2_under_preemption(engines):
    tp1, tp2 = engines
    prompts = _long_prompts(tp1) + [tp1.tokenizer.encode(PROMPTS[0] + " a city")]
    want = [g.token_ids for g in tp1.generate(prompts, GREEDY)]
    before = tp2.get_stats().num_preemptions
    got = [g.token_ids for g in tp2.generate(prompts, GREEDY)]
    assert got == want
    assert tp2.get_stats().num_preemptions > before
    stats = tp2.get_stats()
    assert stats.kv_num_used_blocks == 0
    tp2.check_integrity()


def test_tp2_pool_holds_more_tokens_per_rank(engines):
    tp1, tp2 = engines
    # the same 40 block ids on both ranks: rank 0 keeps 2 of SmolLM2's 3 KV heads, rank 1 one
    assert tp2.core.runner.layout.num_blocks == tp1.core.runner.layout.num_blocks == 40
    assert tp2.core.runner.page_bytes == tp1.core.runner.page_bytes


def test_tp2_close_leaves_no_process():
    engine = Engine(_config(2, num_blocks=8))
    pids = engine.core.runner.pids
    assert engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2))
    engine.close()
    assert all(not _alive(pid) for pid in pids)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, engines):
    """A random 2-layer Llama with one KV head: tp=2 replicates it on both ranks."""
    folder = tmp_path_factory.mktemp("tiny-llama-kv1")
    torch.manual_seed(0)
    config = tiny_hf_config(transformers.LlamaConfig, num_key_value_heads=1, initializer_range=0.5)
    save_hf_folder(folder, transformers.LlamaForCausalLM(config), engines[0].tokenizer)
    return folder


def test_tp2_replicated_kv_head_and_dead_worker(tiny_folder):
    prompt = list(range(5, 45))
    sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with Engine(_config(1, model=str(tiny_folder))) as tp1:
        want = tp1.generate(prompt, sampling)[0].token_ids
    engine = Engine(_config(2, model=str(tiny_folder), num_blocks=64))
    try:
        assert engine.generate(prompt, sampling)[0].token_ids == want
        pids = engine.core.runner.pids
        stream = engine.add_request(prompt, SamplingParams(max_tokens=4000, ignore_eos=True))
        _wait_for_tokens(stream)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            stream.result(timeout=120)
        with pytest.raises(EngineDeadError):
            engine.add_request(prompt, sampling)
    finally:
        engine.close()
    assert all(not _alive(pid) for pid in pids)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]


def _wait_for_tokens(stream) -> None:
    """Until a few tokens arrived: the kill lands mid-generation."""
    received = 0
    while received < 3:
        received += len(stream.get(timeout=120).new_token_ids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive (but it was reaped: gone)
        return f.read().split()[2] != "Z"


def test_parallel_config_validation():
    from agentx import ConfigError

    assert ParallelConfig(tp=2).world_size == 2
    for bad in ({"tp": 0}, {"tp": 1.5}, {"backend": "mpi"}, {"dcp": 2}, {"ep": 2}):
        with pytest.raises(ConfigError):
            ParallelConfig(**bad)
    with pytest.raises(ConfigError):
        EngineConfig(parallel={"tp": 2})
