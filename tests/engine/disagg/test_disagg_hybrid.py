"""P/D hand-over on a linear-attention hybrid (a tiny random Qwen3-Next: two linear-state groups
and a full-attention group, block size 32). P hands D every group's KV up to the exact token,
the full group's partial block and each linear group's running state included: D computes not
one prompt token again (it used to recompute from the last checkpoint every group had), and
the greedy tokens equal one engine's."""

from dataclasses import replace

import pytest

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams
from agentx.config import DisaggConfig, OffloadConfig, SpeculativeConfig
from agentx.engine.disagg import DisaggCoordinator
from tests.helpers.models import random_tokens, save_qwen3_next_folder, tiny_qwen3_next

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
NEXT_BLOCK = 32  # the linear state's page raised the tiny Qwen3-Next's block size to 32


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    folder = tmp_path_factory.mktemp("qwen3-next-pd")
    save_qwen3_next_folder(folder, tiny_qwen3_next())
    cache = CacheConfig(
        block_size=16,
        num_blocks=64,
        retention_policy="interval",
        prefix_cache_retention_interval=32,
    )
    return EngineConfig(
        model=str(folder),
        cache=cache,
        speculative=SpeculativeConfig(enabled=False),
        num_threads=1,
    )


@pytest.fixture(scope="module")
def colocated(config):
    with Engine(config) as engine:
        yield engine


@pytest.fixture(scope="module")
def pd(config, tmp_path_factory):
    tier = OffloadConfig(disk_path=tmp_path_factory.mktemp("pd-hybrid-tier"))
    with DisaggCoordinator(replace(config, offload=tier), DisaggConfig()) as coordinator:
        yield coordinator


@pytest.mark.parametrize(
    ("num_prompt", "num_tail", "num_loaded"),
    [
        (180, 20, 5 + 1 + 2),  # 5 full blocks, the partial one, 2 linear running states
        (192, 0, 6 + 2),  # whole blocks: only the linear states go besides them
    ],
)
def test_a_hybrid_hand_over_resumes_at_the_exact_token(
    pd, colocated, num_prompt, num_tail, num_loaded
):
    prompt = random_tokens(num_prompt, seed=num_prompt)
    expected = colocated.add_request(prompt, GREEDY).result(timeout=300).token_ids
    before, tail_before = pd.instance_stats(), pd.counters.num_handover_tail_tokens
    gen = pd.add_request(prompt, GREEDY).result(timeout=300)
    after = pd.instance_stats()
    assert gen.token_ids == expected
    # D computed P's first token and the 6 decode steps after it: no prompt token again
    computed = {n: after[n].num_computed_tokens - before[n].num_computed_tokens for n in after}
    assert computed == {"prefill-0": num_prompt, "decode-0": 7}
    loaded = after["decode-0"].offload_loaded_blocks - before["decode-0"].offload_loaded_blocks
    assert loaded == num_loaded
    assert pd.counters.num_handover_tail_tokens - tail_before == num_tail
    pd.check_integrity()
    for name, stats in pd.instance_stats().items():
        assert (stats.kv_num_used_blocks, stats.kv_num_held) == (0, 0), name
