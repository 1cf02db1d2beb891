"""Offload tiers through the real engine: greedy tokens identical with and without offload,
through device eviction and reload from host and disk, a new engine starting warm from disk,
corrupt blocks and loads failing midway (recompute, never wrong tokens, no leaked block),
tool-latency demotion and prefetch, release dropping blocks everywhere, and migration of a
session's prefix between engines through a shared tier."""

import time
from pathlib import Path

import pytest

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams
from agentx.config import OffloadConfig
from agentx.engine.hints import ToolLatency

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
POOL = CacheConfig(num_blocks=16)  # 15 blocks of 16 tokens: two 180-token prompts do not fit
PAGE_BYTES = 16 * 30 * 2 * 3 * 64 * 4  # SmolLM2: block size x layers x K/V x heads x dim x fp32


@pytest.fixture(scope="module")
def prompts():
    engine = Engine(EngineConfig(cache=CacheConfig(num_blocks=64, enable_prefix_caching=False)))
    tok = engine.tokenizer
    a = tok.encode("The history of the Roman Empire " * 30)[:180]
    b = tok.encode("A recipe for bread and butter " * 30)[:180]
    yield engine, a, b
    engine.close()


def cold_tokens(prompts, token_ids):
    return prompts[0].add_request(token_ids, GREEDY).result(timeout=300).token_ids


def offload_engine(**offload) -> Engine:
    return Engine(EngineConfig(cache=POOL, offload=OffloadConfig(**offload)))


def run(engine, token_ids, **kw):
    return engine.add_request(token_ids, GREEDY, **kw).result(timeout=300)


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def assert_clean(engine):
    """The exact idle state every test ends in: no request, no held KV (each test's held KV
    was adopted or released), every one of the 15 blocks free with ref count 0, no load or
    prefetch pending."""
    engine.check_integrity()
    with engine._step_lock:
        core = engine.core
        assert not core.scheduler.requests and len(core.kv.held) == 0
        assert core.kv.num_free_blocks == POOL.num_blocks - 1 == 15
        assert [b.ref_cnt for b in core.kv.pool.blocks[1:]] == [0] * 15
        assert not core.offload.loads and not core.offload.tool_waits
    stats = engine.stats()
    assert stats.kv_num_used_blocks == 0 and stats.kv_num_held == 0


def test_device_eviction_and_reload_from_host(prompts):
    _, a, b = prompts
    with offload_engine(host_bytes=64 * PAGE_BYTES) as engine:
        run(engine, a)
        run(engine, b)  # evicts most of a's blocks from the device
        again = a + [13, 42]
        gen = run(engine, again)
        stats = engine.stats()
        assert stats.offload_loaded_blocks > 0
        assert gen.usage.cached_tokens == 176  # 11 full blocks: device hit + host load
        assert gen.token_ids == cold_tokens(prompts, again)
        assert_clean(engine)


def test_a_new_engine_starts_warm_from_disk(prompts, tmp_path):
    _, a, _ = prompts
    with offload_engine(disk_path=tmp_path) as first:
        run(first, a)
    assert list(tmp_path.rglob("*"))  # blocks written down
    with offload_engine(disk_path=tmp_path) as second:
        again = a + [7]
        gen = run(second, again)
        assert second.stats().offload_loaded_blocks == 11
        assert gen.usage.cached_tokens == 176
        assert gen.token_ids == cold_tokens(prompts, again)
        assert_clean(second)


def test_corrupt_disk_blocks_are_misses_not_wrong_tokens(prompts, tmp_path):
    _, a, _ = prompts
    with offload_engine(disk_path=tmp_path) as first:
        run(first, a)
    files = [p for p in Path(tmp_path).rglob("*") if p.is_file() and p.stat().st_size > 4096]
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    with offload_engine(disk_path=tmp_path) as second:
        again = a + [7]
        gen = run(second, again)
        assert gen.token_ids == cold_tokens(prompts, again)
        stats = second.stats()
        assert stats.offload_loaded_blocks < 11
        assert_clean(second)


def test_a_load_failing_midway_falls_back_to_recompute(prompts):
    _, a, b = prompts
    with offload_engine(host_bytes=64 * PAGE_BYTES) as engine:
        run(engine, a)
        run(engine, b)
        tier = engine.core.offload.store.tiers[0]
        read = tier.read

        def failing_read(hashes, pages):
            ok = read(hashes, pages)
            return [flag and i < 2 for i, flag in enumerate(ok)]  # the third block on fails

        tier.read = failing_read
        again = a + [13, 42]
        gen = run(engine, again)
        stats = engine.stats()
        assert stats.offload_loaded_blocks == 2 and stats.offload_failed_blocks > 0
        assert gen.token_ids == cold_tokens(prompts, again)
        assert_clean(engine)


def test_abort_while_loading_leaks_nothing(prompts):
    _, a, b = prompts
    with offload_engine(host_bytes=64 * PAGE_BYTES) as engine:
        run(engine, a)
        run(engine, b)
        tier = engine.core.offload.store.tiers[0]
        read = tier.read
        tier.read = lambda hashes, pages: (time.sleep(0.5), read(hashes, pages))[1]
        stream = engine.add_request(a + [5], GREEDY)
        wait_for(lambda: engine.core.scheduler.parked)
        engine.abort(stream.request_id)
        wait_for(lambda: not engine.core.offload.loads and not engine.core.scheduler.requests)
        engine.check_integrity()
        stats = engine.stats()
        assert stats.kv_num_used_blocks == 0 and stats.kv_num_held == 0


def test_tool_latency_demotes_then_prefetches_before_the_tool_returns(prompts):
    _, a, b = prompts
    with offload_engine(host_bytes=64 * PAGE_BYTES, prefetch_margin_s=0.5) as engine:
        now = [1000.0]
        engine.core.offload.clock = lambda: now[0]
        first = engine.add_request(a, GREEDY, hold_kv=True, hints=(ToolLatency(30.0),))
        gen1 = first.result(timeout=300)
        run(engine, b)  # needs the room: the session waiting on its tool is released
        assert engine.stats().kv_num_held == 0
        now[0] += 29.6  # within the margin of the expected return
        wait_for(lambda: engine.stats().offload_num_prefetches == 1)
        wait_for(lambda: engine.stats().kv_num_held == 1)
        turn2 = a + gen1.token_ids + [13, 42, 7]
        gen2 = run(engine, turn2, held_kv=first.request_id)
        assert gen2.usage.cached_tokens == 176  # the full blocks came back before the turn
        assert gen2.token_ids == cold_tokens(prompts, turn2)
        assert_clean(engine)


def test_release_drops_a_session_everywhere_and_pin_reaches_the_tiers(prompts):
    _, a, _ = prompts
    with offload_engine(host_bytes=64 * PAGE_BYTES) as engine:
        stream = engine.add_request(a, GREEDY, hold_kv=True)
        stream.result(timeout=300)
        stats = engine.stats()  # 185 computed tokens held: 12 blocks, one reference each
        assert stats.kv_num_held == 1 and stats.kv_num_used_blocks == 12
        offload = engine.core.offload
        with engine._step_lock:
            offload.flush()
            hashes = offload.held_hashes(stream.request_id)
        assert len(hashes) == 11 and offload.store.lookup(hashes).num_hits == 11
        assert engine.pin_held(stream.request_id)
        assert offload.store.tiers[0].get_stats().num_pinned == 11
        assert engine.release_held(stream.request_id, drop_cached=True)
        assert offload.store.lookup(hashes).num_hits == 0
        assert_clean(engine)


def test_migration_between_engines_through_a_shared_tier(prompts, tmp_path):
    _, a, _ = prompts
    with offload_engine(disk_path=tmp_path) as source, offload_engine(disk_path=tmp_path) as dest:
        stream = source.add_request(a, GREEDY, hold_kv=True)
        gen = stream.result(timeout=300)
        export = source.export_held(stream.request_id)
        assert export is not None and len(export.block_hashes) == 11
        handle = dest.import_held(export)
        assert handle is not None
        turn2 = a + gen.token_ids + [13, 42]
        moved = run(dest, turn2, held_kv=handle)
        assert moved.usage.cached_tokens == 176
        assert moved.token_ids == cold_tokens(prompts, turn2)
        assert_clean(dest)


def test_a_hinted_turn_is_demoted_first_and_prefetched_into_the_device_cache(prompts):
    _, a, b = prompts
    with offload_engine(host_bytes=64 * PAGE_BYTES, prefetch_margin_s=0.5) as engine:
        now = [1000.0]
        engine.core.offload.clock = lambda: now[0]
        first = engine.add_request(a, GREEDY, hints=(ToolLatency(30.0),))
        first.result(timeout=300)
        pool = engine.core.kv.pool
        wait_for(lambda: engine.core.offload.tool_waits)
        with engine._step_lock:
            front = pool.free_queue.get_block_ids()[:11]
            hashes = engine.core.offload.tool_waits[f"prefetch:{first.request_id}"].block_hashes
            demoted = [pool.get_cached_block(h).block_id for h in hashes]
        assert sorted(front) == sorted(demoted)  # first in line for reuse: the host keeps them
        run(engine, b)
        with engine._step_lock:
            assert sum(pool.get_cached_block(h) is not None for h in hashes) < 11
        now[0] += 29.6
        wait_for(lambda: engine.stats().offload_num_prefetches == 1)
        wait_for(lambda: all(pool.get_cached_block(h) is not None for h in hashes))
        again = a + [13, 42]
        gen = run(engine, again)
        assert gen.usage.cached_tokens == 176
        assert not engine.core.scheduler.parked
        assert gen.token_ids == cold_tokens(prompts, again)
        assert_clean(engine)


def test_check_integrity_holds_while_a_load_is_in_flight(prompts):
    """A load references its device blocks before any request or held KV owns them: the
    check counts those references (was: "ref_cnt 1, held by 0 requests" mid-load)."""
    from agentx.engine.core import EngineCore

    _, a, b = prompts
    core = EngineCore(EngineConfig(cache=POOL, offload=OffloadConfig(host_bytes=64 * PAGE_BYTES)))
    try:
        tokens: dict[str, list[int]] = {}
        for rid, token_ids in (("a", a), ("b", b), ("again", a + [13, 42])):
            core.add_request(core.make_request(rid, token_ids, GREEDY))
            if rid == "again":
                assert core.scheduler.parked and core.offload.loads  # its prefix loads
                assert core.offload.get_referenced_blocks()
                core.check_integrity()
            while core.has_unfinished_requests():
                for out in core.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                core.check_integrity()
        assert tokens["again"] == cold_tokens(prompts, a + [13, 42])
        assert core.offload.get_referenced_blocks() == []
        assert core.kv.get_num_used_blocks() == 0
    finally:
        core.close()
