"""Decode context parallel: each rank holds every N-th position of each request's KV, attends
over its part with the log-sum-exp, and the parts merge to full attention.

The kernel tests split one paged cache into N ranks' caches in-process and compare against the
reference paged attention over the whole cache (awkward lengths: 1, 15, 63 tokens; GQA;
prefill, chunked prefill and decode rows in one batch). The engine test runs dcp=2 in worker
processes against tp=1 on SmolLM2 with prefix caching, chunked prefill and preemption on.
Greedy tokens hold on the prompts below, not on every prompt, for the reason tensor parallel
has (tests/engine/parallel/test_parallel_tp.py): at dcp=1 the layers run fused, a DCP rank runs op
by op with
the merged attention (float64, see attention_partial.py), so near-ties can go the other way (4
of 8 probe prompts behind a 72-token prefix keep all 24 tokens; the others differ at 7 to 21).
"""

from dataclasses import replace

import pytest
import torch

from agentx import CacheConfig, ConfigError, Engine, EngineConfig, ParallelConfig
from agentx.engine.models.loader import load_checkpoint
from agentx.engine.parallel import ParallelState
from agentx.engine.runner.model_runner import plan_rank_layout, scheduler_layout
from agentx.kernels.ref import merge_attention_parts, paged_attention, paged_attention_partial
from tests.helpers.parallel import long_prompts, tp_config
from tests.helpers.parity import PARITY_PROMPTS, check_close_cached_and_preempted

MIN_EXACT = 3


def _split_cache(full: torch.Tensor, num_ranks: int) -> list[torch.Tensor]:
    """(nb, 2, B, Hkv, D) -> per rank (nb, 2, B / N, Hkv, D): rank r keeps offsets o % N == r."""
    return [full[:, :, r::num_ranks].contiguous() for r in range(num_ranks)]


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_partial_attention_merges_to_full_attention(num_ranks):
    torch.manual_seed(0)
    block_size, num_heads, num_kv_heads, head_dim = 16, 6, 2, 8
    # request 0 prefills 15 tokens, 1 decodes at 63, 2 is a first token, 3 a chunk at 33..47
    seq_lens, num_new = [15, 63, 1, 48], [15, 1, 1, 15]
    query_start_loc = [0]
    for n in num_new:
        query_start_loc.append(query_start_loc[-1] + n)
    num_blocks = 1 + sum(-(-s // block_size) for s in seq_lens)
    cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim)
    perm = torch.randperm(num_blocks - 1) + 1  # scattered block ids, never the null block
    tables, used = torch.zeros(len(seq_lens), 4, dtype=torch.long), 0
    for i, s in enumerate(seq_lens):
        n = -(-s // block_size)
        tables[i, :n] = perm[used : used + n]
        used += n
    q = torch.randn(query_start_loc[-1], num_heads, head_dim)
    decode_ids = torch.tensor([i for i, n in enumerate(num_new) if n == 1])
    prefill_ids = [i for i, n in enumerate(num_new) if n > 1]
    want = paged_attention(
        q, cache, query_start_loc, seq_lens, tables, decode_ids, prefill_ids, 0.3
    )
    parts = [
        paged_attention_partial(q, c, query_start_loc, seq_lens, tables, 0.3, num_ranks, r)
        for r, c in enumerate(_split_cache(cache, num_ranks))
    ]
    outs = torch.stack([o for o, _ in parts])
    lses = torch.stack([lse for _, lse in parts])
    assert torch.isinf(lses[num_ranks - 1, query_start_loc[2]]).all()  # 1 token: rank 0 only
    got = merge_attention_parts(outs, lses)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_dcp_holds_n_times_the_tokens_per_rank():
    spec = load_checkpoint(None, torch.float32).spec
    block_bytes = 2 * 16 * spec.num_kv_heads * spec.head_dim * 2 * spec.num_layers  # bf16 K, V
    config = EngineConfig(cache=CacheConfig(kv_cache_bytes=20 * block_bytes))
    one = plan_rank_layout(config, spec, None, torch.bfloat16, ParallelState())
    two = ParallelState(dcp_rank=1, dcp_size=2)
    local = plan_rank_layout(config, spec, None, torch.bfloat16, two)
    planned = scheduler_layout(local, two)
    assert planned.block_size == one.block_size == 16
    assert local.block_size == 8  # each rank keeps half of every scheduler block
    assert (one.num_blocks, planned.num_blocks) == (20, 40)  # same bytes per rank: x2 tokens


def test_dcp_config():
    assert ParallelConfig(dcp=2).world_size == 2
    assert ParallelConfig(tp=2, dcp=2).world_size == 4  # TP x DCP: test_parallel_tp_dcp.py
    with pytest.raises(ConfigError):
        EngineConfig(cache=CacheConfig(block_size=1), parallel=ParallelConfig(dcp=2))


@pytest.fixture(scope="module")
def engines():
    dcp2 = Engine(replace(tp_config(1), parallel=ParallelConfig(dcp=2)))
    tp1 = Engine(tp_config(1))
    yield tp1, dcp2
    tp1.close()
    dcp2.close()


@pytest.mark.slow  # real SmolLM2 engines in worker processes
def test_dcp2_greedy_close_to_dcp1_cached_and_preempted(engines):
    tp1, dcp2 = engines
    prompts = long_prompts(tp1, list(PARITY_PROMPTS))
    names = ("dcp=1", "dcp=2")
    check_close_cached_and_preempted(tp1, dcp2, prompts, min_exact=MIN_EXACT, names=names)
