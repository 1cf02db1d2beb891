"""Prefill context parallel: pcp=2 on the dcp=2 ranks, two worker processes (gloo on loopback).

A long prefill's rows are split zig-zag over the ranks (exact rows and counts below); each rank
runs the model over its rows, the attention gathers q / k / v and runs as DCP. The engine test
reads both ranks' KV pools after one prompt and finds DCP's layout (rank r holds the offsets
o % 2 == r of each scheduler block, every KV head), counts the rows each rank ran (about half of
the prefill, every decode row), then checks greedy tokens against world size 1 with prefix
caching, chunked prefill (16-token chunks, so every chunk is split) and preemption on, and that
a worker killed mid-step fails the engine with EngineDeadError, leaving no process behind.

The model is the tiny random Llama of tests/engine/parallel/test_parallel_tp_dcp.py, not SmolLM2:
world size 1
is the baseline because the tiny model has no near-ties at these prompts (at world size 1 a
layer may run fused, a DCP rank runs op by op with float64 merged attention; SmolLM2 has
near-ties, tests/engine/parallel/test_parallel_dcp.py). What pcp adds to dcp changes no number a
token sees:
projections, MLP and norms are per row, and the attention is DCP's over the gathered rows.
"""

from dataclasses import replace

import pytest
import torch
import transformers

from agentx import ConfigError, Engine, ParallelConfig, SamplingParams
from agentx.engine.executors.worker import WorkerCall
from agentx.engine.models.loader import load_checkpoint
from agentx.engine.parallel import PrefillSplit, zigzag_rows
from tests.helpers.models import save_hf_folder, tiny_hf_config
from tests.helpers.parallel import (
    assert_no_process_left,
    check_greedy_cached_and_preempted,
    kill_rank_mid_generation,
    tp_config,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SMOLLM2_MIN_EXACT = 3
SHARED = list(range(100, 164))  # 64 tokens: 4 full scheduler blocks


def test_zigzag_split_is_balanced():
    # 18 rows, 4 pieces 5 | 5 | 4 | 4: rank 0 pieces 0 and 3, rank 1 pieces 1 and 2
    assert zigzag_rows([18], 2, 0) == [*range(0, 5), *range(14, 18)]
    assert zigzag_rows([18], 2, 1) == list(range(5, 14))
    # a decode row and a 3-token tail run on both ranks; the 16-token chunk splits 4 | 8 | 4
    assert zigzag_rows([1, 16, 3], 2, 0) == [0, 1, 2, 3, 4, 13, 14, 15, 16, 17, 18, 19]
    assert zigzag_rows([1, 16, 3], 2, 1) == [0, *range(5, 13), 17, 18, 19]
    # 2048 rows over 4 ranks: 256-row pieces, 512 rows each; the causal cost (keys seen, sum
    # of position + 1) of the two pieces is the same on every rank
    for rank in range(4):
        rows = zigzag_rows([2048], 4, rank)
        assert len(rows) == 512
        assert sum(r + 1 for r in rows) == 256 * 2049
    # 17 rows over 2 ranks: pieces 5 | 4 | 4 | 4, 9 and 8 rows
    assert [len(zigzag_rows([17], 2, r)) for r in range(2)] == [9, 8]
    assert PrefillSplit.build([1, 1, 3], 2, 0) is None  # nothing to split: a DCP step


def test_pcp_config():
    assert ParallelConfig(dcp=2, pcp=2).world_size == 2  # the same ranks
    for bad in ({"pcp": 2}, {"pcp": 2, "dcp": 4}, {"pcp": 2, "dcp": 2, "tp": 2}):
        with pytest.raises(ConfigError):
            ParallelConfig(**bad)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-pcp")
    torch.manual_seed(0)
    config = tiny_hf_config(transformers.LlamaConfig, initializer_range=0.5)
    tokenizer = load_checkpoint(None, torch.float32).tokenizer
    save_hf_folder(folder, transformers.LlamaForCausalLM(config), tokenizer)
    return folder


def _prompts(num: int) -> list[list[int]]:
    return [SHARED + list(range(1000 + 37 * i, 1000 + 37 * i + 20 + 3 * i)) for i in range(num)]


def test_pcp2_layout_rows_greedy_preemption_and_dead_worker(tiny_folder):
    config = tp_config(1, model=str(tiny_folder))
    one = Engine(config)
    pcp = Engine(replace(config, parallel=ParallelConfig(dcp=2, pcp=2)))
    try:
        _check_kv_layout_and_rows(one, pcp)
        check_greedy_cached_and_preempted(one, pcp, _prompts, GREEDY)
        # rank 1 killed on a long prompt: it dies inside a split prefill or a decode
        assert len(pcp.core.runner.pids) == 2
        pids = kill_rank_mid_generation(pcp, 1, _prompts(1)[0], 60, GREEDY)
    finally:
        one.close()
        pcp.close()
    assert_no_process_left(pids)


def _rows_run(engine: Engine) -> list[int]:
    return engine.core.runner._call(WorkerCall("get_num_rows_run", gather=True))


def _check_kv_layout_and_rows(one: Engine, pcp: Engine) -> None:
    """Fresh engines, one 84-token prompt (16-token chunks): rank r holds scheduler offsets
    o % 2 == r at its offset o // 2, every KV head; it ran half of each chunk's rows."""
    spec, runner = one.core.runner.spec, one.core.runner
    prompt = _prompts(1)[0]
    before = _rows_run(pcp)  # the warm-up's 32-row prefill and one decode row
    assert before == [16 + 1, 16 + 1]
    assert pcp.generate(prompt, GREEDY)[0].token_ids == one.generate(prompt, GREEDY)[0].token_ids
    # 84 rows in chunks 16 x 5 + 4: each 16-row chunk 8 a rank, the 4-row tail 2 a rank (its
    # 4 pieces of one row), then 11 decode rows on both ranks
    rows = [after - b for after, b in zip(_rows_run(pcp), before, strict=True)]
    assert rows == [5 * 8 + 2 + 11] * 2
    assert pcp.core.runner.layout.num_blocks == runner.layout.num_blocks
    ids = list(range(runner.layout.num_blocks))
    block = (spec.num_layers, 2, 16, spec.num_kv_heads, spec.head_dim)
    full = runner.gather_pages(ids).view(runner.kv_dtype).view(len(ids), *block)
    pages = pcp.core.runner.gather_pages(ids)
    assert pages.shape[1] == runner.page_bytes  # 2 ranks x half the offsets, every head
    local = (len(ids), spec.num_layers, 2, 8, spec.num_kv_heads, spec.head_dim)
    parts = [p.contiguous().view(runner.kv_dtype).view(local) for p in pages.chunk(2, dim=1)]
    written = full.flatten(1).ne(0).any(1).nonzero().flatten().tolist()
    assert written == list(range(1, 1 + -(-(len(prompt) + GREEDY.max_tokens - 1) // 16)))
    for rank, part in enumerate(parts):
        torch.testing.assert_close(part, full[:, :, :, rank::2], rtol=2e-2, atol=2e-2)


@pytest.mark.slow  # real SmolLM2 engines in worker processes
def test_smollm2_pcp2_greedy_close_to_world_size_1():
    """SmolLM2 behind the 72-token shared prefix, 16-token chunks: close to world size 1 by
    the parity rule (tests/helpers/parity.py), exact against itself from the prefix cache."""
    from tests.helpers.parallel import long_prompts
    from tests.helpers.parity import PARITY_PROMPTS, check_close_cached_and_preempted

    with (
        Engine(tp_config(1)) as one,
        Engine(replace(tp_config(1), parallel=ParallelConfig(dcp=2, pcp=2))) as pcp,
    ):
        prompts = long_prompts(one, list(PARITY_PROMPTS))
        names = ("world size 1", "pcp=2")
        check_close_cached_and_preempted(
            one, pcp, prompts, min_exact=SMOLLM2_MIN_EXACT, names=names
        )
