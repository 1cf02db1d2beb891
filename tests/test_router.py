"""The data-parallel session router: sticky sessions, cold first turns to the least loaded."""

import pytest

from agentx import CacheConfig, ConfigError, Engine, EngineConfig, ParallelConfig, SamplingParams
from agentx.engine.router import (
    LeastLoadedPolicy,
    ReplicaLoad,
    ReplicaRouter,
    RoundRobinPolicy,
    StickySessionPolicy,
)


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


def test_baselines():
    rr = RoundRobinPolicy()
    assert [rr.choose("s", _loads(0, 0, 0)) for _ in range(4)] == [0, 1, 2, 0]
    ll = LeastLoadedPolicy()
    assert ll.choose("s", [ReplicaLoad(1, 3), ReplicaLoad(1, 2)]) == 1  # ties: fewer sessions
    assert ll.choose("s", _loads(0, 0)) == 0


def test_router_over_two_replicas():
    config = EngineConfig(cache=CacheConfig(num_blocks=64), parallel=ParallelConfig(dp=2))
    with pytest.raises(ConfigError):
        Engine(config)  # an Engine is one replica
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with ReplicaRouter(config) as router:
        long_prompt = "You are a careful assistant. " * 8 + "The capital of France is"
        first, stream = router.add_request(long_prompt, greedy, session_id="s1")
        other, stream2 = router.add_request("def f(x):", greedy, session_id="s2")
        assert other != first  # s1's turn is live on its replica: s2 goes to the idle one
        turn1 = stream.result(timeout=120)
        stream2.result(timeout=120)
        prompt = turn1.prompt_token_ids + turn1.token_ids
        again, stream = router.add_request(prompt, greedy, session_id="s1")
        assert again == first
        assert stream.result(timeout=120).usage.cached_tokens > 0  # its KV was there
        with pytest.raises(ConfigError):
            ReplicaRouter(config, policy="random")
