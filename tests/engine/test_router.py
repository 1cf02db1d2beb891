"""The data-parallel session router: sticky sessions, cold first turns to the least loaded, and
a waiting session migrating with its KV off an overloaded replica through a shared disk tier."""

import os
import queue
import subprocess
import sys
import threading
from dataclasses import replace

import pytest
import torch

import agentx
from agentx import (
    CacheConfig,
    ConfigError,
    Engine,
    EngineConfig,
    EngineDeadError,
    ParallelConfig,
    RequestAbortedError,
    SamplingParams,
)
from agentx.config import OffloadConfig, SchedulerConfig
from agentx.engine.request import Request
from agentx.engine.router import (
    LeastLoadedPolicy,
    Migration,
    PrefixIndex,
    ReplicaLoad,
    ReplicaRouter,
    RoundRobinPolicy,
    RouterStats,
    StickySessionPolicy,
)

ROOT = os.path.dirname(os.path.dirname(agentx.__file__))


def _loads(*live: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(n, 0) for n in live]


def test_sticky_keeps_a_session_and_sends_first_turns_to_the_least_loaded():
    policy = StickySessionPolicy()
    assert policy.choose("a", _loads(3, 1)) == 1  # cold: least loaded
    assert policy.choose("b", _loads(0, 5)) == 0
    assert policy.choose("a", _loads(0, 9)) == 1  # warm: where its KV is, whatever the load
    assert policy.choose(None, _loads(2, 1)) == 1  # no session: least loaded, nothing kept
    assert policy.home == {"a": 1, "b": 0}
    policy.forget("a")
    assert policy.choose("a", _loads(0, 9)) == 0


def test_prefix_index_hashes_are_the_engines_block_hashes():
    """The router names blocks as the replicas' prefix caches do (blake2b chains over the
    token ids and the cache salt), not with Python's per-process ``hash()``."""
    tokens = list(range(3, 40))
    index = PrefixIndex(2, block_tokens=8)
    for salt in (None, "tenant-a"):
        request = Request(
            "r",
            tokens,
            SamplingParams(),
            block_size=8,
            cache_salt=salt.encode() if salt else b"",
        )
        assert index.hashes(tokens, salt) == request.block_hashes
        assert len(request.block_hashes) == 4
    code = (
        "from agentx.engine.router import PrefixIndex; "
        "print(PrefixIndex(1, block_tokens=8).hashes(list(range(3, 40)), 'tenant-a')[-1].hex())"
    )
    digests = set()
    for seed in ("1", "2"):  # another process, another str hash seed: the same names
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": ROOT}
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        )
        digests.add(result.stdout.strip())
    assert digests == {index.hashes(tokens, "tenant-a")[-1].hex()}


def test_prefix_index_matches_whole_leading_blocks_per_replica():
    index = PrefixIndex(2, block_tokens=4, max_blocks=3)
    a = index.hashes(list(range(10)))  # 2 whole blocks; the last 2 tokens are not indexed
    assert len(a) == 2 and index.hashes(list(range(8))) == a
    assert index.hashes(list(range(10)), salt="tenant") != a  # a salt is another cache
    assert index.hashes([9, 1, 2, 3, 4, 5, 6, 7])[1] != a[1]  # a block's hash covers its past
    index.record(1, a)
    assert index.matched_tokens(a) == [0, 8]
    assert index.matched_tokens(index.hashes([0, 1, 2, 3, 9, 9, 9, 9, 9, 9, 9, 9])) == [0, 4]
    index.record(1, index.hashes(list(range(100, 108))))  # 4 blocks on 1: its oldest dropped
    assert index.num_blocks(1) == 3 and index.matched_tokens(a) == [0, 0]
    index.check_integrity()
    with pytest.raises(ConfigError):
        PrefixIndex(2, block_tokens=4, max_blocks=0)


def test_sticky_sends_a_first_turn_to_the_replica_with_its_prefix():
    policy = StickySessionPolicy(prefix_min_tokens=64, prefix_load_slack=2)
    assert policy.choose("a", [ReplicaLoad(2, 1, 64), ReplicaLoad(0, 0, 0)]) == 0  # slack 2
    assert policy.choose("b", [ReplicaLoad(3, 1, 64), ReplicaLoad(0, 0, 0)]) == 1  # too busy
    assert policy.choose("c", [ReplicaLoad(0, 1, 48), ReplicaLoad(1, 0, 0)]) == 0  # idle anyway
    assert policy.choose("d", [ReplicaLoad(1, 1, 48), ReplicaLoad(0, 0, 0)]) == 1  # too short
    assert policy.choose("e", [ReplicaLoad(1, 1, 96), ReplicaLoad(1, 0, 160)]) == 1  # longest
    assert policy.choose("a", [ReplicaLoad(0, 1, 0), ReplicaLoad(9, 0, 0)]) == 0  # warm: home
    plain = StickySessionPolicy(prefix_min_tokens=None)
    assert plain.choose("a", [ReplicaLoad(1, 1, 999), ReplicaLoad(0, 0, 0)]) == 1
    for bad in ({"prefix_min_tokens": 0}, {"prefix_load_slack": -1}):
        with pytest.raises(ConfigError):
            StickySessionPolicy(**bad)


def test_baselines():
    rr = RoundRobinPolicy()
    assert [rr.choose("s", _loads(0, 0, 0)) for _ in range(4)] == [0, 1, 2, 0]
    ll = LeastLoadedPolicy()
    assert ll.choose("s", [ReplicaLoad(1, 3), ReplicaLoad(1, 2)]) == 1  # ties: fewer sessions
    assert ll.choose("s", _loads(0, 0)) == 0


def test_policies_never_choose_a_dead_replica():
    dead0 = [ReplicaLoad(0, 0, alive=False), ReplicaLoad(3, 2), ReplicaLoad(5, 0)]
    assert LeastLoadedPolicy().choose("s", dead0) == 1  # not the dead one's zero load
    rr = RoundRobinPolicy()
    assert [rr.choose(None, dead0) for _ in range(4)] == [1, 2, 1, 2]
    sticky = StickySessionPolicy(prefix_min_tokens=16)
    assert sticky.choose("a", _loads(0, 0, 0)) == 0
    assert sticky.choose("a", dead0) == 1  # its home died: placed again, among the live
    assert sticky.home == {"a": 1}
    warm_but_dead = [ReplicaLoad(0, 0, 999, alive=False), ReplicaLoad(1, 0), ReplicaLoad(2, 0)]
    assert sticky.choose("b", warm_but_dead) == 1  # a dead replica's prefix is gone


def test_router_over_two_replicas():
    config = EngineConfig(cache=CacheConfig(num_blocks=64), parallel=ParallelConfig(dp=2))
    with pytest.raises(ConfigError):
        Engine(config)  # an Engine is one replica
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with ReplicaRouter(config) as router:
        long_prompt = "You are a careful assistant. " * 8 + "The capital of France is"
        first, stream = router.route(long_prompt, greedy, session_id="s1")
        other, stream2 = router.route("def f(x):", greedy, session_id="s2")
        assert other != first  # s1's turn is live on its replica: s2 goes to the idle one
        turn1 = stream.result(timeout=120)
        stream2.result(timeout=120)
        prompt = turn1.prompt_token_ids + turn1.token_ids
        again, stream = router.route(prompt, greedy, session_id="s1")
        assert again == first
        router.check_integrity()
        assert stream.result(timeout=120).usage.cached_tokens > 0  # its KV was there
        with pytest.raises(ConfigError):
            ReplicaRouter(config, policy="random")


def test_sticky_migrates_a_session_off_an_overloaded_home():
    policy = StickySessionPolicy(migrate_after=2)
    assert policy.migrates_kv and not StickySessionPolicy().migrates_kv
    assert policy.choose("a", _loads(0, 0)) == 0
    assert policy.choose("a", _loads(2, 0)) == 0  # 2 more than the least loaded: stays
    assert policy.choose("a", _loads(3, 0)) == 1  # 3 more: moves, and 1 is its home now
    assert policy.choose("a", _loads(0, 2)) == 1
    assert policy.home == {"a": 1}
    with pytest.raises(ConfigError):
        StickySessionPolicy(migrate_after=-1)


def test_a_migrating_policy_needs_a_shared_tier():
    config = EngineConfig(cache=CacheConfig(num_blocks=64), parallel=ParallelConfig(dp=2))
    with pytest.raises(ConfigError, match="share"):
        ReplicaRouter(config, StickySessionPolicy(migrate_after=0))
    auto = EngineConfig(offload=OffloadConfig(mooncake="auto"), parallel=ParallelConfig(dp=2))
    with pytest.raises(ConfigError, match="share"):  # a master per replica is not one tier
        ReplicaRouter(auto, StickySessionPolicy(migrate_after=0))


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _overload(router, replica):
    """A long request live on ``replica``: its load is one more than the idle one's."""
    return router.replicas[replica].add_request("Count to a thousand:", SamplingParams(
        temperature=0.0, max_tokens=200, ignore_eos=True))  # fmt: skip


def _end(router, blocker):
    router.replicas[0].abort(blocker.request_id)
    with pytest.raises(RequestAbortedError):
        blocker.result(timeout=120)


def test_a_waiting_session_migrates_with_its_kv_through_a_shared_disk_tier(tmp_path):
    config = EngineConfig(
        cache=CacheConfig(num_blocks=64),
        offload=OffloadConfig(disk_path=tmp_path),
        parallel=ParallelConfig(dp=2),
    )
    with ReplicaRouter(config, StickySessionPolicy(migrate_after=0)) as router:
        tok = router.tokenizer
        a = tok.encode("The history of the Roman Empire " * 30)[:180]
        b = tok.encode("A recipe for bread and butter " * 30)[:180]
        home, stream = router.route(a, GREEDY, session_id="s")
        gen = stream.result(timeout=300)  # 185 tokens computed: 11 full blocks on disk
        assert home == 0
        blocker = _overload(router, 0)
        turn2 = a + gen.token_ids + [13, 42]  # 188 tokens: 11 full blocks before the last
        moved, stream = router.route(turn2, GREEDY, session_id="s")
        _end(router, blocker)
        migrated = stream.result(timeout=300)
        assert moved == 1 and migrated.usage.cached_tokens == 176  # loaded, not recomputed
        stay = router.replicas[0].add_request(turn2, GREEDY).result(timeout=300)
        # at home the first turn's partial last block is cached too: its 9 tokens are copied
        # (the tiers hold whole blocks)
        assert stay.usage.cached_tokens == 185 and migrated.token_ids == stay.token_ids
        dst = router.replicas[1]
        assert dst.stats().offload_loaded_blocks == 11
        assert dst.core.offload.store.num_hits == {"disk": 11}

        # held KV: exported at home, imported on the target, released at home
        home, stream = router.route(b, GREEDY, session_id="h", hold_kv=True)
        gen = stream.result(timeout=300)
        assert home == 0 and router.replicas[0].stats().kv_num_held == 1
        blocker = _overload(router, 0)
        turn2 = b + gen.token_ids + [13, 42]
        moved, stream = router.route(turn2, GREEDY, session_id="h", held_kv=stream.request_id)
        _end(router, blocker)
        migrated = stream.result(timeout=300)
        assert moved == 1 and migrated.usage.cached_tokens == 176
        assert router.replicas[0].stats().kv_num_held == 0
        stay = router.replicas[0].add_request(turn2, GREEDY).result(timeout=300)
        assert migrated.token_ids == stay.token_ids
        assert dst.stats().offload_loaded_blocks == 22
        assert dst.core.offload.store.num_hits == {"disk": 22}

        assert router.migrations == [Migration("s", 0, 1, 0), Migration("h", 0, 1, 176)]
        assert router.policy.home == {"s": 1, "h": 1}
        router.check_integrity()
        router.end_session("s")
        assert router.policy.home == {"h": 1}
        router.check_integrity()
        for engine in router.replicas:
            stats = engine.stats()
            assert stats.kv_num_held == 0 and stats.kv_num_used_blocks == 0


def test_a_subagent_first_turn_goes_to_its_parents_replica():
    config = EngineConfig(cache=CacheConfig(num_blocks=64), parallel=ParallelConfig(dp=2))
    with ReplicaRouter(config) as router:
        tok = router.tokenizer
        parent = tok.encode("The history of the Roman Empire " * 30)[:180]
        home, stream = router.route(parent, GREEDY, session_id="p")
        gen = stream.result(timeout=300)  # 185 tokens computed: 11 full blocks cached
        assert home == 0
        context = parent + gen.token_ids
        blocker = _overload(router, 0)  # the parent's replica is one request busier
        fork, stream = router.route(context + [13, 42], GREEDY, session_id="p/sub-0")
        sub = stream.result(timeout=300)
        # every token the parent computed: its 11 whole blocks, then its partial last one's 9
        assert fork == 0 and sub.usage.cached_tokens == 185
        other = tok.encode("A recipe for bread and butter " * 30)[:180]
        cold, stream = router.route(other, GREEDY, session_id="q")  # no prefix anywhere
        assert cold == 1 and stream.result(timeout=300).usage.cached_tokens == 0
        salted, stream = router.route(  # another tenant's cache: nothing to share
            context + [7], GREEDY, session_id="r", cache_salt="tenant-b"
        )
        assert salted == 1 and stream.result(timeout=300).usage.cached_tokens == 0
        _end(router, blocker)
        assert router.policy.home == {"p": 0, "p/sub-0": 0, "q": 1, "r": 1}
        router.check_integrity()
        for engine in router.replicas:
            assert engine.stats().kv_num_used_blocks == 0


def test_replicas_share_one_step_clock_and_run_their_own_thread_count():
    config = EngineConfig(
        num_threads=1,
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(prefill_schedule_interval=4),
        parallel=ParallelConfig(dp=2),
    )
    threads_here = torch.get_num_threads()
    built = []  # built on another thread: set_num_threads acts on the thread that calls it
    builder = threading.Thread(target=lambda: built.append(ReplicaRouter(config)))
    builder.start()
    builder.join()
    with built[0] as router:
        clocks = [engine.core.scheduler.cadence.clock for engine in router.replicas]
        assert clocks == [router.step_clock] * 2
        for r in range(2):
            router.replicas[r].add_request("def f(x):", GREEDY).result(timeout=120)
        # replica 1's first step takes the shared index replica 0 reached, not a count of its own
        indices = [engine.core.scheduler.cadence.index for engine in router.replicas]
        steps = [engine.stats().num_steps for engine in router.replicas]
        assert indices == [steps[0] - 1, steps[0] - 1 + steps[1] - 1]
        assert router.step_clock.get_index() == indices[1]
        assert torch.get_num_threads() == threads_here
        seen = queue.Queue()
        for engine in router.replicas:
            engine._control(lambda core: seen.put(torch.get_num_threads()))
        assert [seen.get(timeout=60) for _ in router.replicas] == [1, 1]  # each loop thread
    unaligned = replace(config, num_threads=None)
    with ReplicaRouter(unaligned, align_prefills=False) as router:
        assert router.step_clock is None
        assert router.replicas[0].core.scheduler.cadence.clock is None


def test_a_dead_replica_gets_no_work_and_its_sessions_move(tmp_path):
    config = EngineConfig(
        cache=CacheConfig(num_blocks=64),
        offload=OffloadConfig(disk_path=tmp_path),
        parallel=ParallelConfig(dp=2),
    )
    with ReplicaRouter(config) as router:
        a = router.tokenizer.encode("The history of the Roman Empire " * 30)[:180]
        home, stream = router.route(a, GREEDY, session_id="s", hold_kv=True)
        gen = stream.result(timeout=300)  # 185 tokens computed: 11 full blocks
        assert home == 0
        router.replicas[0].flush_offload()  # its blocks landed in the shared tier ...

        def boom():
            raise RuntimeError("injected fault")

        router.replicas[0].core.step = boom  # ... before its loop crashed
        with pytest.raises(EngineDeadError):
            router.replicas[0].add_request("crash it").result(timeout=120)
        assert router.replicas[0].is_dead

        short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        routed = [router.route("def f(x):", short, session_id=f"new-{i}") for i in range(10)]
        assert [replica for replica, _ in routed] == [1] * 10  # was: 5 of 10 sent to the dead
        assert all(len(s.result(timeout=300).token_ids) == 2 for _, s in routed)

        turn2 = a + gen.token_ids + [13, 42]  # 188 tokens: 11 full blocks before the last
        moved, stream = router.route(turn2, GREEDY, session_id="s", held_kv=stream.request_id)
        out = stream.result(timeout=300)
        assert moved == 1 and out.usage.cached_tokens == 176  # loaded from the disk tier
        assert len(out.token_ids) == 6
        assert router.get_stats() == RouterStats(
            num_replicas=2, num_dead_replicas=1, num_migrations=0, num_moved_sessions=1
        )
        assert router.policy.home == {"s": 1, **{f"new-{i}": 1 for i in range(10)}}
        again, stream = router.route(turn2 + out.token_ids, short, session_id="s")
        assert again == 1 and stream.result(timeout=300).usage.cached_tokens >= 176
        assert router.get_stats().num_moved_sessions == 1  # it lives on replica 1 now
        router.check_integrity()
        assert router.replicas[1].stats().kv_num_held == 0
        router.replicas[1].core.step = boom
        with pytest.raises(EngineDeadError):
            router.replicas[1].add_request("crash it").result(timeout=120)
        with pytest.raises(EngineDeadError, match="every replica"):
            router.route("def f(x):", short, session_id="last")


@pytest.mark.slow
def test_a_session_off_a_dead_replica_without_a_shared_tier_is_recomputed():
    """No tier to load from: the moved turn computes its whole prompt on the live replica and
    gets the tokens a cold run gets; its held KV died with its home."""
    config = EngineConfig(cache=CacheConfig(num_blocks=64), parallel=ParallelConfig(dp=2))
    with ReplicaRouter(config) as router:
        a = router.tokenizer.encode("The history of the Roman Empire " * 30)[:180]
        home, stream = router.route(a, GREEDY, session_id="s", hold_kv=True)
        gen = stream.result(timeout=300)
        assert home == 0

        def boom():
            raise RuntimeError("injected fault")

        router.replicas[0].core.step = boom
        with pytest.raises(EngineDeadError):
            router.replicas[0].add_request("crash it").result(timeout=120)

        turn2 = a + gen.token_ids + [13, 42]
        moved, stream = router.route(turn2, GREEDY, session_id="s", held_kv=stream.request_id)
        out = stream.result(timeout=300)
        assert moved == 1 and out.usage.cached_tokens == 0  # nothing to load: recomputed
        cold = router.replicas[1].add_request(turn2, GREEDY, cache_salt="cold")
        assert out.token_ids == cold.result(timeout=300).token_ids
        assert router.get_stats().num_moved_sessions == 1
        router.check_integrity()
        assert router.replicas[1].stats().kv_num_held == 0
