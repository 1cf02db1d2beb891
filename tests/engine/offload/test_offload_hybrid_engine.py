"""Offload tiers on hybrid KV layouts through the real engine: a tiny random Qwen3-Next
(linear-attention checkpoints + full attention) and Gemma 3 270M (sliding-window + full
attention, real weights). A session's KV is evicted from a small device pool, reloaded from
host, disk or Mooncake on its next turn to the one length every group agrees on, and the
greedy tokens equal a cold run's; without tiers the same turn recomputes everything. A session
migrated with its tail (``export_held(include_tail=True)``) resumes at the exact token."""

from pathlib import Path

import pytest

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams
from agentx.config import OffloadConfig
from agentx.engine.models.loader import gemma3_270m_path
from agentx.engine.offload import mooncake_master as launcher
from tests.helpers.models import random_tokens, save_qwen3_next_folder, tiny_qwen3_next

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
NEXT_BLOCK = 32  # the linear state's page raised the tiny Qwen3-Next's block size to 32
# two 180-token sessions do not fit: interval retention's prefill takes a page per 32-token
# checkpoint, marconi's only the running ones, so it gets the smaller pool
NEXT_POOL = {"interval": 20, "marconi": 14}


@pytest.fixture(scope="module")
def next_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3-next-offload")
    save_qwen3_next_folder(folder, tiny_qwen3_next())
    return folder


def next_engine(folder: Path, policy: str = "interval", **offload) -> Engine:
    cache = CacheConfig(
        block_size=16,
        num_blocks=NEXT_POOL[policy],
        retention_policy=policy,
        prefix_cache_retention_interval=32 if policy == "interval" else 0,
    )
    return Engine(EngineConfig(model=str(folder), cache=cache, offload=OffloadConfig(**offload)))


@pytest.fixture(scope="module")
def next_turns(next_folder):
    """Session a's two turns and their cold greedy tokens; b, the session that evicts a."""
    a, b = random_tokens(180, seed=11), random_tokens(180, seed=12)
    cache = CacheConfig(block_size=16, num_blocks=64, enable_prefix_caching=False)
    with Engine(EngineConfig(model=str(next_folder), cache=cache)) as cold:
        first = cold.add_request(a, GREEDY).result(timeout=120).token_ids
        second = a + first + [5, 6, 7]  # 191 tokens: a hit of at most 5 blocks (160)
        expected = cold.add_request(second, GREEDY).result(timeout=120).token_ids
    return a, b, first, second, expected


def session_turns(engine: Engine, turns) -> tuple:
    """Turn 1 of session a (held), session b (its room releases a's held KV), turn 2 of a."""
    a, b, first, second, _ = turns
    stream = engine.add_request(a, GREEDY, hold_kv=True)
    assert stream.result(timeout=300).token_ids == first
    engine.add_request(b, GREEDY).result(timeout=300)
    assert engine.stats().kv_num_held == 0  # released for b: only the tiers keep a now
    return engine.add_request(second, GREEDY, held_kv=stream.request_id).result(timeout=300)


def assert_idle(engine: Engine) -> None:
    engine.check_integrity()
    with engine._step_lock:
        core = engine.core
        assert not core.scheduler.requests and len(core.kv.held) == 0
        assert core.kv.num_free_blocks == core.kv.pool.num_blocks - 1
        assert not core.offload.loads


@pytest.mark.parametrize("policy", ["interval", "marconi"])
def test_qwen3_next_session_reloads_from_host_with_the_same_tokens(next_folder, next_turns, policy):
    *_, second, expected = next_turns
    with next_engine(next_folder, policy) as plain:
        gen = session_turns(plain, next_turns)
        assert gen.usage.cached_tokens == 0  # every checkpoint was evicted: all recomputed
        assert gen.token_ids == expected
    with next_engine(next_folder, policy, host_bytes=8 << 20) as engine:
        gen = session_turns(engine, next_turns)
        # 5 blocks agreed: the full group's 5 and each linear group's checkpoint at 160
        # (interval: every 32 tokens; marconi: the rolling latest boundary of turn 1)
        assert gen.usage.cached_tokens == 5 * NEXT_BLOCK
        assert len(second) - gen.usage.cached_tokens == 31  # recomputed
        assert gen.token_ids == expected
        # of the 7 blocks the hit needs (5 full, a checkpoint per linear group), the rest were
        # still cached on the device
        assert engine.stats().offload_loaded_blocks == {"interval": 6, "marconi": 4}[policy]
        assert_idle(engine)


def test_qwen3_next_a_new_engine_starts_warm_from_disk(next_folder, next_turns, tmp_path):
    a, _, first, second, expected = next_turns
    with next_engine(next_folder, disk_path=tmp_path) as writer:
        assert writer.add_request(a, GREEDY).result(timeout=120).token_ids == first
    with next_engine(next_folder, disk_path=tmp_path) as reader:
        gen = reader.add_request(second, GREEDY).result(timeout=120)
        assert gen.usage.cached_tokens == 5 * NEXT_BLOCK
        # the full group's 5 blocks and the two linear groups' checkpoints at 160
        assert reader.stats().offload_loaded_blocks == 5 + 2
        assert gen.token_ids == expected
        assert_idle(reader)


def test_qwen3_next_migrates_a_session_through_a_shared_disk(next_folder, next_turns, tmp_path):
    a, _, first, second, expected = next_turns
    with (
        next_engine(next_folder, disk_path=tmp_path) as source,
        next_engine(next_folder, disk_path=tmp_path) as dest,
    ):
        stream = source.add_request(a, GREEDY, hold_kv=True)
        assert stream.result(timeout=120).token_ids == first
        export = source.export_held(stream.request_id, include_tail=True)
        # 187 tokens held: 5 full blocks, the full group's partial block and each linear
        # group's running state (it used to stop at 160, the last checkpoint every group had)
        assert export is not None and export.num_tokens == 187
        assert len(export.tail_token_ids) == 187 - 5 * NEXT_BLOCK
        handle = dest.import_held(export)
        assert handle is not None and dest.stats().kv_num_held == 1
        assert dest.stats().offload_loaded_blocks == 5 + 1 + 2
        gen = dest.add_request(second, GREEDY, held_kv=handle).result(timeout=120)
        assert gen.usage.cached_tokens == 187 and gen.token_ids == expected
        assert source.release_held(stream.request_id)
        assert_idle(source)
        assert_idle(dest)


@pytest.mark.skipif(
    not launcher.has_private_network(),
    reason="Mooncake binds every interface: run inside a private network namespace "
    "(make test runs pytest under unshare -n)",
)
def test_qwen3_next_session_reloads_from_mooncake(next_folder, next_turns, tmp_path):
    *_, second, expected = next_turns
    master = launcher.MooncakeMaster(log_path=tmp_path / "master.log").start()
    try:
        with next_engine(next_folder, mooncake=master.address, mooncake_bytes=16 << 20) as engine:
            gen = session_turns(engine, next_turns)
            assert gen.usage.cached_tokens == 5 * NEXT_BLOCK
            assert len(second) - gen.usage.cached_tokens == 31
            assert gen.token_ids == expected
            assert engine.stats().offload_loaded_blocks == 7 - 1
            assert_idle(engine)
    finally:
        master.stop()


GEMMA_POOL = 240  # a 600-token session takes 208 blocks (5 sliding groups + 1 full)
GEMMA_WINDOW_BLOCKS = 32  # a hit needs the sliding groups' last 511 tokens: 32 blocks


def test_gemma3_session_reloads_its_window_from_host_and_disk(tmp_path):
    path = str(gemma3_270m_path())
    cold_cache = CacheConfig(num_blocks=260, enable_prefix_caching=False)
    with Engine(EngineConfig(model=path, cache=cold_cache)) as cold:
        tok = cold.tokenizer
        a = tok.encode("The history of the Roman Empire, told year by year. " * 60)[:600]
        b = tok.encode("A recipe for bread and butter, step by careful step. " * 60)[:600]
        first = cold.add_request(a, GREEDY).result(timeout=600).token_ids
        second = a + first + [5, 6, 7]
        expected = cold.add_request(second, GREEDY).result(timeout=600).token_ids
    # host for 300 of the 444 blocks the two sessions publish: a's older ones are demoted to
    # disk and load from there, its newer ones from host
    offload = OffloadConfig(host_bytes=300 * 98304, disk_path=tmp_path)
    config = EngineConfig(model=path, cache=CacheConfig(num_blocks=GEMMA_POOL), offload=offload)
    with Engine(config) as engine:
        gen = session_turns(engine, (a, b, first, second, expected))
        # 37 full blocks (608 computed: the 38th is not full): full group 37 blocks, each of 5
        # sliding groups its last 32
        assert gen.usage.cached_tokens == 37 * 16
        assert gen.token_ids == expected
        stats = engine.stats()
        hits = engine.core.offload.store.num_hits
        # at most 37 + 5 x 32 = 197 blocks (what the device still caches is not loaded): a
        # full-attention-only layout would load up to 6 x 37 = 222
        assert (stats.offload_loaded_blocks, hits) == (186, {"host": 62, "disk": 124}), hits
        assert stats.offload_failed_blocks == 0
        assert_idle(engine)


def test_gemma3_migrates_a_session_to_the_exact_token(tmp_path):
    path = str(gemma3_270m_path())
    cold_cache = CacheConfig(num_blocks=260, enable_prefix_caching=False)
    with Engine(EngineConfig(model=path, cache=cold_cache)) as cold:
        a = cold.tokenizer.encode("The history of the Roman Empire, told year by year. " * 60)
        a = a[:600]
        first = cold.add_request(a, GREEDY).result(timeout=600).token_ids
        second = a + first + [5, 6, 7]
        expected = cold.add_request(second, GREEDY).result(timeout=600).token_ids
    offload = OffloadConfig(disk_path=tmp_path)
    config = EngineConfig(model=path, cache=CacheConfig(num_blocks=260), offload=offload)
    with Engine(config) as source, Engine(config) as dest:
        stream = source.add_request(a, GREEDY, hold_kv=True)
        assert stream.result(timeout=600).token_ids == first
        export = source.export_held(stream.request_id, include_tail=True)
        # 607 tokens held: 37 full blocks and 15 tokens. The full group sends all 37, each
        # sliding group the 31 its next token's window (the 511 tokens before it) reads, 6..36,
        # and every group its partial block (it used to stop at 592, the last boundary)
        assert export is not None and export.num_tokens == 607
        handle = dest.import_held(export)
        assert dest.stats().offload_loaded_blocks == 37 + 5 * 31 + 6
        gen = dest.add_request(second, GREEDY, held_kv=handle).result(timeout=600)
        assert gen.usage.cached_tokens == 607 and gen.token_ids == expected
        assert source.release_held(stream.request_id)
        assert_idle(source)
        assert_idle(dest)
