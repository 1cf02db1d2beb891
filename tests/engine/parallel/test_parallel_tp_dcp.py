"""Tensor parallel x decode context parallel: tp=2, dcp=2, four worker processes (gloo on
loopback), rank = dcp_rank * tp + tp_rank (``engine/executors/worker.py``).

Rank (d, t) holds KV head shard t of the positions p with p % 2 == d. The test reads every
rank's KV pool after one prompt and finds exactly that: each rank's page is its shard of the
world-size-1 page (half the offsets, its KV head), nothing else written. Greedy tokens then
equal world size 1 with prefix caching, chunked prefill and preemption on, and a worker killed
mid-step fails the engine with EngineDeadError, leaving no process behind.

The layout, fault and most greedy checks use the tiny random Llama of the TP tests (4 query
heads, 2 KV heads: one KV head per tp rank): it has no near-ties at these prompts, so every
prompt must match world size 1 (tests/engine/parallel/test_parallel_tp.py checks tp=2 against it the
same way):
the claim is "TP x DCP computes the same model", not "TP x DCP equals TP". SmolLM2 at 2 x 2 runs
on named prompts, for the reason tests/engine/parallel/test_parallel_tp.py gives (near-ties under
another float
order: the ranks run op by op, world size 1 runs the fused layer); four SmolLM2 ranks on two
cores take about a minute for it.
"""

from dataclasses import replace

import pytest
import torch
import transformers

from agentx import (
    CacheConfig,
    Engine,
    EngineConfig,
    ParallelConfig,
    SamplingParams,
)
from agentx.engine.models.loader import load_checkpoint
from agentx.engine.parallel import ParallelState
from agentx.engine.runner.model_runner import plan_rank_layout, scheduler_layout
from tests.helpers.models import save_hf_folder, tiny_hf_config
from tests.helpers.parallel import (
    assert_no_process_left,
    check_greedy_cached_and_preempted,
    kill_rank_mid_generation,
    long_prompts,
    tp_config,
)
from tests.helpers.parity import PARITY_PROMPTS, check_close_cached_and_preempted

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SHARED = list(range(100, 164))  # 64 tokens: 4 full scheduler blocks


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-tpdcp")
    torch.manual_seed(0)
    config = tiny_hf_config(transformers.LlamaConfig, initializer_range=0.5)
    tokenizer = load_checkpoint(None, torch.float32).tokenizer
    save_hf_folder(folder, transformers.LlamaForCausalLM(config), tokenizer)
    return folder


def _prompts(num: int) -> list[list[int]]:
    return [SHARED + list(range(1000 + 37 * i, 1000 + 37 * i + 20 + 3 * i)) for i in range(num)]


def _rank_pages(pages: torch.Tensor, dtype: torch.dtype, shape: tuple) -> list[torch.Tensor]:
    """(n, 4 ranks' page bytes) -> per rank (n, layers, 2, block, kv heads, head dim)."""
    return [p.contiguous().view(dtype).view(len(pages), *shape) for p in pages.chunk(4, dim=1)]


def test_tp2_dcp2_layout_greedy_preemption_and_dead_worker(tiny_folder):
    config = tp_config(1, model=str(tiny_folder))
    one = Engine(config)
    grid = Engine(replace(config, parallel=ParallelConfig(tp=2, dcp=2)))
    try:
        _check_kv_layout(one, grid)
        check_greedy_cached_and_preempted(one, grid, _prompts, GREEDY)
        # rank 3 (dcp 1, tp 1: in tp group {2, 3} and dcp group {1, 3})
        assert len(grid.core.runner.pids) == 4
        pids = kill_rank_mid_generation(grid, 3, _prompts(1)[0], 60, GREEDY)
    finally:
        one.close()
        grid.close()
    assert_no_process_left(pids)


def _check_kv_layout(one: Engine, grid: Engine) -> None:
    """Fresh engines, one prompt: the same block ids on both; rank (d, t) holds KV head t at
    scheduler offsets o with o % 2 == d, at its offset o // 2."""
    spec, runner = one.core.runner.spec, one.core.runner
    prompt = _prompts(1)[0]
    assert grid.generate(prompt, GREEDY)[0].token_ids == one.generate(prompt, GREEDY)[0].token_ids
    assert grid.core.runner.layout.num_blocks == runner.layout.num_blocks
    assert grid.core.runner.layout.groups[0].spec.block_size == 16
    ids = list(range(runner.layout.num_blocks))
    block = (spec.num_layers, 2, 16, spec.num_kv_heads, spec.head_dim)
    full = runner.gather_pages(ids).view(runner.kv_dtype).view(len(ids), *block)
    pages = grid.core.runner.gather_pages(ids)
    assert pages.shape[1] == runner.page_bytes  # 4 ranks x (half the offsets, half the heads)
    local = (spec.num_layers, 2, 8, 1, spec.head_dim)
    parts = _rank_pages(pages, runner.kv_dtype, local)
    written = full.flatten(1).ne(0).any(1).nonzero().flatten().tolist()
    assert written == list(range(1, 1 + -(-(len(prompt) + GREEDY.max_tokens - 1) // 16)))
    for rank, part in enumerate(parts):
        d, t = divmod(rank, 2)
        want = full[:, :, :, d::2, t : t + 1]  # (n, layers, 2, 8, 1, head dim)
        torch.testing.assert_close(part, want, rtol=2e-2, atol=2e-2)


def test_smollm2_tokens_per_rank_from_the_layout():
    """SmolLM2 (3 KV heads) at tp=2 x dcp=2: rank (d, t) keeps KV heads 2 / 1 (t = 0 / 1) of 8
    of every 16-token block; every rank plans as many blocks as the widest (t = 0) fits."""
    spec = load_checkpoint(None, torch.float32).spec
    block_bytes = 2 * 16 * spec.num_kv_heads * spec.head_dim * 2 * spec.num_layers  # bf16 K, V
    config = EngineConfig(cache=CacheConfig(kv_cache_bytes=20 * block_bytes))
    one = plan_rank_layout(config, spec, None, torch.bfloat16, ParallelState())
    planned = []
    for rank in range(4):
        d, t = divmod(rank, 2)
        state = ParallelState(tp_rank=t, tp_size=2, dcp_rank=d, dcp_size=2)
        local = plan_rank_layout(config, spec, None, torch.bfloat16, state)
        assert local.groups[0].spec.block_size == 8
        assert local.groups[0].spec.num_kv_heads == (2, 1)[t]
        planned.append(scheduler_layout(local, state))
    assert one.num_blocks == 20  # 320 tokens at world size 1
    # x1.5 (the widest rank holds 2 of 3 KV heads) x2 (half of each block): 60 blocks, 960 tokens
    assert {(p.num_blocks, p.groups[0].spec.block_size) for p in planned} == {(60, 16)}


SMOLLM2_MIN_EXACT = 3


@pytest.mark.slow  # real SmolLM2 engines in worker processes
def test_smollm2_tp2_dcp2_greedy_close_to_world_size_1():
    one = Engine(tp_config(1))
    grid = Engine(replace(tp_config(1), parallel=ParallelConfig(tp=2, dcp=2)))
    try:
        prompts = long_prompts(one, list(PARITY_PROMPTS))
        names = ("world size 1", "tp=2 x dcp=2")
        check_close_cached_and_preempted(
            one, grid, prompts, min_exact=SMOLLM2_MIN_EXACT, names=names
        )
    finally:
        one.close()
        grid.close()
