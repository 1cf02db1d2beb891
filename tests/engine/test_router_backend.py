"""The router as an engine backend: a Session runs its turns on a 2-replica router, each turn
on the home replica's held KV; a session waiting on a long tool moves, KV and all, to a less
loaded replica before its next turn (off the router's lock, on the router's mover thread)."""

import anyio

from agentx import CacheConfig, EngineConfig, ParallelConfig, SamplingParams, Session
from agentx.config import OffloadConfig
from agentx.engine.backend import EngineBackend
from agentx.engine.hints import ToolLatency
from agentx.engine.router import Migration, ReplicaRouter, RouterStats, StickySessionPolicy

SHORT = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


async def test_a_session_runs_three_turns_on_its_home_replica():
    config = EngineConfig(cache=CacheConfig(num_blocks=96), parallel=ParallelConfig(dp=2))
    router = await anyio.to_thread.run_sync(ReplicaRouter, config)
    with router:
        assert isinstance(router, EngineBackend)
        caps = router.capabilities()
        assert caps.name == "agentx-router" and caps.session_affinity and caps.exact_held_kv
        async with Session(router, sampling=SHORT) as s:
            r1 = await s.send("Name a color.")
            previous = r1.usage.prompt_tokens + r1.usage.output_tokens
            [home] = [r for r, e in enumerate(router.replicas) if e.stats().kv_num_held == 1]
            for follow_up in ("Another one.", "And one more."):
                r = await s.send(follow_up)
                assert r.usage.cached_tokens == previous - 1 > 0  # the held KV, at home
                previous = r.usage.prompt_tokens + r.usage.output_tokens
                assert router.replicas[home].stats().kv_num_held == 1
                assert router.replicas[1 - home].stats().num_generated_tokens == 0
            [child] = await s.fork(1)  # a fork is a session beside its parent
            c = await child.send("And a shape?")
            assert c.usage.cached_tokens == previous - 1
            assert router.replicas[1 - home].stats().num_generated_tokens == 0
            await child.close()
            router.check_integrity()
        assert router.stats().num_generated_tokens == 4 * 6
        assert router.get_stats() == RouterStats(2, 0, 0, 0, 0)


def _overload(router, replica):
    return router.replicas[replica].add_request("Count to a thousand:", SamplingParams(
        temperature=0.0, max_tokens=400, ignore_eos=True))  # fmt: skip


def test_a_session_moves_with_its_held_kv_while_its_tool_runs(tmp_path):
    config = EngineConfig(
        cache=CacheConfig(num_blocks=64),
        offload=OffloadConfig(disk_path=tmp_path),
        parallel=ParallelConfig(dp=2),
    )
    with ReplicaRouter(config, StickySessionPolicy(migrate_after=0)) as router:
        tok = router.tokenizer
        a = tok.encode("A recipe for bread and butter " * 30)[:180]
        options = {"hold_kv": True, "hints": (ToolLatency(8.0),)}
        home, stream = router.route(a, SHORT, session_id="s", **options)
        assert home == 0
        blocker = _overload(router, 0)  # live while the turn ends: home is the busier one
        gen = stream.result(timeout=300)  # 185 tokens computed: 11 full blocks
        assert router.flush_moves(timeout=120)
        assert router.migrations == [Migration("s", 0, 1, 176, during_tool_wait=True)]
        assert router.get_stats().num_tool_wait_migrations == 1
        assert router.replicas[0].stats().kv_num_held == 0
        assert router.replicas[1].stats().kv_num_held == 1  # imported under the same handle
        assert router.policy.home == {"s": 1}
        turn2 = a + gen.token_ids + [13, 42]
        moved, stream = router.route(turn2, SHORT, session_id="s", held_kv=gen.request_id)
        second = stream.result(timeout=300)
        assert moved == 1 and second.usage.cached_tokens == 176  # found on the target
        assert len(router.migrations) == 1  # nothing moved when the turn was routed
        router.replicas[0].abort(blocker.request_id)
        router.check_integrity()


def test_a_short_tool_wait_or_an_idle_home_does_not_move(tmp_path):
    config = EngineConfig(
        cache=CacheConfig(num_blocks=64),
        offload=OffloadConfig(disk_path=tmp_path),
        parallel=ParallelConfig(dp=2),
    )
    policy = StickySessionPolicy(migrate_after=0)
    with ReplicaRouter(config, policy, tool_wait_move_s=5.0) as router:
        a = router.tokenizer.encode("The history of the Roman Empire " * 10)[:60]
        _, short = router.route(a, SHORT, session_id="s", hold_kv=True, hints=(ToolLatency(1.0),))
        short.result(timeout=300)
        _, idle = router.route(a, SHORT, session_id="t", hold_kv=True, hints=(ToolLatency(9.0),))
        idle.result(timeout=300)  # queued a move; both replicas idle: it stays
        assert router.flush_moves(timeout=60)
        assert router.migrations == [] and router.policy.home == {"s": 0, "t": 1}
        router.check_integrity()
