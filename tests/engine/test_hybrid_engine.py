"""A linear-attention hybrid (tiny random Qwen3-Next) through the real engine: greedy tokens equal
transformers', and stay identical cold vs with prefix hits across a 10-turn conversation and
across forks; hits on turn 2 onwards come from linear-state checkpoints (none without them)."""

import pytest
import torch

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig
from tests.helpers.models import random_tokens, save_qwen3_next_folder, tiny_qwen3_next

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_and_folder(tmp_path_factory):
    hf = tiny_qwen3_next()
    folder = tmp_path_factory.mktemp("qwen3-next-engine")
    save_qwen3_next_folder(folder, hf)
    return hf, folder


@pytest.fixture(scope="module")
def engines(hf_and_folder):
    """Engines by retention policy name (and "cold": no prefix caching); block size 16."""
    _, folder = hf_and_folder
    built = {}

    def get(name: str, budget: int = 2048) -> Engine:
        key = (name, budget)
        if key not in built:
            cache = CacheConfig(
                block_size=16,
                num_blocks=256,
                enable_prefix_caching=name != "cold",
                retention_policy=name if name != "cold" else "none",
                prefix_cache_retention_interval=32 if name == "interval" else 0,
            )
            sched = SchedulerConfig(max_num_batched_tokens=budget)
            built[key] = Engine(EngineConfig(model=str(folder), cache=cache, scheduler=sched))
        return built[key]

    yield get
    for engine in built.values():
        engine.close()


def run(engine, prompt, **kw):
    return engine.add_request(prompt, GREEDY, **kw).result(timeout=120)


def test_layout_puts_linear_and_attention_layers_in_one_pool(engines):
    engine = engines("cold")
    layout = engine.core.runner.layout
    kinds = [type(g.spec).__name__ for g in layout.groups]
    # 3 linear + 2 full layers -> groups of 2: (0, 2), (3,) linear; (1, 4) full
    assert kinds == ["LinearStateSpec", "LinearStateSpec", "FullAttentionSpec"]
    assert [g.layer_ids for g in layout.groups] == [(0, 2), (3,), (1, 4)]
    assert layout.page_size_bytes == max(g.spec.page_size_bytes for g in layout.groups)
    assert layout.num_slots == 2


def test_greedy_equals_transformers_with_chunked_prefill(hf_and_folder, engines):
    hf, _ = hf_and_folder
    prompt = random_tokens(90, seed=1)
    with torch.inference_mode():
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8
        )[0, len(prompt) :].tolist()
    assert run(engines("cold"), prompt).token_ids == expected
    chunked = engines("cold", budget=24)  # 90 tokens in 4 chunks, states carried in pages
    assert run(chunked, prompt).token_ids == expected
    chunked.check_integrity()


@pytest.mark.parametrize("policy", ["marconi", "interval"])
def test_ten_turns_hit_checkpoints_and_match_cold(engines, policy):
    engine, cold = engines(policy), engines("cold")
    prompt = random_tokens(40, seed=2)
    for turn in range(10):
        gen = run(engine, prompt)
        assert gen.token_ids == run(cold, prompt).token_ids, f"turn {turn}"
        if turn == 0:
            assert gen.usage.cached_tokens == 0
        else:
            # the rolling checkpoint of the previous turn (marconi) / its prompt end (interval)
            assert gen.usage.cached_tokens >= 32, f"turn {turn}: {gen.usage}"
        prompt = prompt + gen.token_ids + random_tokens(7, seed=100 + turn)
    engine.check_integrity()


def test_without_checkpoints_a_hybrid_gets_no_hits(engines):
    engine = engines("none")
    prompt = random_tokens(40, seed=3)
    for _ in range(3):
        gen = run(engine, prompt)
        assert gen.usage.cached_tokens == 0
        prompt = prompt + gen.token_ids + random_tokens(5, seed=7)


def test_held_forks_continue_their_own_linear_state(engines):
    engine, cold = engines("marconi"), engines("cold")
    parent_prompt = random_tokens(37, seed=4)
    stream = engine.add_request(parent_prompt, GREEDY, hold_kv=True)
    parent = stream.result(timeout=120)
    handles = engine.fork_held(stream.request_id, 3)
    assert len(handles) == 3
    base = parent_prompt + parent.token_ids
    children = [base + random_tokens(5, seed=10 + i) for i in range(3)]
    pairs = zip(children, handles, strict=True)
    streams = [engine.add_request(c, GREEDY, held_kv=h) for c, h in pairs]
    for child, s in zip(children, streams, strict=True):
        gen = s.result(timeout=120)
        assert gen.usage.cached_tokens == len(base) - 1  # the whole held state, tail included
        assert gen.token_ids == run(cold, child).token_ids
    assert engine.release_held(stream.request_id)
    engine.check_integrity()


def test_a_pool_too_small_for_interval_checkpoints_serves_the_request(hf_and_folder, engines):
    """180 + 8 tokens need 6 full blocks and 2 pages per linear group: 10, the whole pool.
    Interval retention plans a checkpoint every 32 tokens, 5 per linear group in the prefill:
    the engine leaves them out instead of waiting for room that never comes (it used to)."""
    _, folder = hf_and_folder
    prompt = random_tokens(180, seed=31)
    expected = run(engines("cold"), prompt).token_ids
    cache = CacheConfig(
        block_size=16,
        num_blocks=11,
        retention_policy="interval",
        prefix_cache_retention_interval=32,
    )
    with Engine(EngineConfig(model=str(folder), cache=cache)) as engine:
        assert run(engine, prompt).token_ids == expected  # a timeout, not a hang, if it waits
        engine.check_integrity()
        stats = engine.stats()
        assert stats.kv_dropped_checkpoints == 2 * 5
        assert (stats.kv_num_used_blocks, stats.num_preemptions) == (0, 0)
