"""Replay on the fake engine: tree ordering, the concurrency limit, think time, stop, errors."""

import asyncio

import pytest

from agentx.bench.adapter import BenchEngineError, Done, Tokens
from agentx.bench.fake_adapter import FakeAdapter
from agentx.bench.replay import Replay, ReplayConfig
from agentx.bench.trace import SessionTrace, Subagent, Trace, TraceRequest
from agentx.bench.trace_stats import think_bound
from agentx.errors import ConfigError


def r(n_in, n_out, ids, think=0.0):
    return TraceRequest(0.0, n_in, n_out, tuple(ids), think)


def tree_trace():
    steps = (
        r(128, 3, [1, 2]),
        Subagent(0.0, "a", (r(150, 3, [1, 2, 10]), r(200, 3, [1, 2, 10, 11]))),
        Subagent(0.0, "b", (r(140, 3, [1, 2, 20]),)),
        r(192, 3, [1, 2, 3]),
    )
    return Trace("t", 64, (SessionTrace("s", steps),))


def replay(trace, engine, **kw):
    async def go():
        rep = Replay(trace, engine, ReplayConfig(progress=False, **kw))
        return await rep.run(await engine.start())

    return asyncio.run(go())


def test_parent_waits_for_its_subagents():
    engine = FakeAdapter(decode_s_per_token=0.01)
    result = replay(tree_trace(), engine)
    assert engine.log == [
        ("start", "s#0", "s"),
        ("done", "s#0", "s"),
        ("start", "s/a#0", "s/a"),  # the two subagents run side by side
        ("start", "s/b#0", "s/b"),
        ("done", "s/a#0", "s/a"),
        ("start", "s/a#1", "s/a"),
        ("done", "s/b#0", "s/b"),
        ("done", "s/a#1", "s/a"),
        ("start", "s#1", "s"),  # only after both subagents finished
        ("done", "s#1", "s"),
        ("end_session", "s", "s"),
        ("end_session", "s/a", "s/a"),
        ("end_session", "s/b", "s/b"),
    ]
    by_id = {x.request_id: x for x in result.records}
    assert by_id["s#1"].submit_time >= max(by_id["s/a#1"].end_time, by_id["s/b#0"].end_time)
    assert [x.num_output_tokens for x in result.records] == [3, 3, 3, 3, 3]
    assert len(by_id["s#0"].token_times) == 3
    # cached (fake: 16-token blocks) vs theoretical (64-token blocks seen before)
    cached = {k: (v.num_cached_tokens, v.theoretical_hit_tokens) for k, v in by_id.items()}
    assert cached == {
        "s#0": (0, 0),
        "s/a#0": (128, 128),
        # block 10 was seen, as a partial block of 22 tokens: the definition counts all 64 of
        # it now, the fake engine (16-token blocks) could cache 16 of them
        "s/a#1": (144, 192),
        "s/b#0": (128, 128),
        "s#1": (128, 128),
    }
    assert result.num_requests_planned == 5 and not result.interrupted


def test_concurrency_limits_live_session_trees():
    sessions = tuple(SessionTrace(f"s{i}", (r(64, 4, [i]),)) for i in range(5))
    engine = FakeAdapter(decode_s_per_token=0.01)
    result = replay(Trace("t", 64, sessions), engine, concurrency=2)
    assert engine.max_live == 2
    starts = [e[1] for e in engine.log if e[0] == "start"]
    assert starts == ["s0#0", "s1#0", "s2#0", "s3#0", "s4#0"]
    by_id = {x.request_id: x for x in result.records}
    assert by_id["s2#0"].submit_time >= min(by_id["s0#0"].end_time, by_id["s1#0"].end_time)
    engine = FakeAdapter(decode_s_per_token=0.01)
    replay(Trace("t", 64, sessions), engine, concurrency=8)
    assert engine.max_live == 5


def test_think_time_is_honoured_and_capped():
    steps = (r(64, 2, [1]), r(128, 2, [1, 2], think=0.3))
    trace = Trace("t", 64, (SessionTrace("s", steps),))
    for cap, low, high in ((1.0, 0.3, 0.6), (0.1, 0.1, 0.28)):
        result = replay(trace, FakeAdapter(), max_think=cap)
        first, second = result.records
        gap = second.submit_time - first.end_time
        assert low <= gap < high, (cap, gap)
    result = replay(trace, FakeAdapter(), max_think=0)
    assert result.records[1].submit_time - result.records[0].end_time < 0.1


def test_stop_keeps_what_was_measured():
    sessions = tuple(SessionTrace(f"s{i}", (r(64, 3, [i]), r(64, 50, [i]))) for i in range(3))
    engine = FakeAdapter(decode_s_per_token=0.01)

    async def go():
        rep = Replay(Trace("t", 64, sessions), engine, ReplayConfig(3, progress=False))
        asyncio.get_running_loop().call_later(0.15, rep.stop)
        return await rep.run(await engine.start())

    result = asyncio.run(go())
    assert result.interrupted
    assert [x.request_id for x in result.records] == ["s0#0", "s1#0", "s2#0"]
    assert result.num_requests_planned == 6


class FailingAdapter(FakeAdapter):
    async def generate(self, request):
        if request.request_id == "s#0":
            yield Tokens(1)
            raise BenchEngineError("boom")
        yield Tokens(request.max_tokens)
        yield Done(request.max_tokens, None)


def test_a_failed_request_is_recorded_and_the_agent_goes_on():
    steps = (r(64, 2, [1]), r(128, 2, [1, 2]))
    result = replay(Trace("t", 64, (SessionTrace("s", steps),)), FailingAdapter())
    first, second = result.records
    assert (first.error, first.num_output_tokens) == ("BenchEngineError: boom", 1)
    assert second.ok and second.num_output_tokens == 2 and second.num_cached_tokens is None
    assert len(set(second.token_times)) == 1  # one event carrying both tokens


def think_trace():
    """Three sessions whose think times alone take 0.3, 0.4 (a subagent group as long as its
    longest member) and 0.2 s."""
    a = (r(64, 2, [1]), r(64, 2, [1, 2], think=0.3))
    b = (
        r(64, 2, [3]),
        Subagent(0.0, "x", (r(64, 2, [3, 4], think=0.1), r(64, 2, [3, 5], think=0.25))),
        Subagent(0.0, "y", (r(64, 2, [3, 6], think=0.3),)),
        r(64, 2, [3, 7], think=0.05),
    )
    c = (r(64, 2, [8], think=0.2),)
    return Trace("t", 64, (SessionTrace("a", a), SessionTrace("b", b), SessionTrace("c", c)))


def test_think_bound_schedules_sessions_as_the_replay_does():
    trace = think_trace()
    # one slot: 0.3 + 0.4 + 0.2; two: a and b start, c takes a's slot at 0.3 and ends at 0.5
    assert think_bound(trace, 1, 5.0) == pytest.approx(0.9)
    assert think_bound(trace, 2, 5.0) == pytest.approx(0.5)
    assert think_bound(trace, 3, 5.0) == think_bound(trace, 8, 5.0) == pytest.approx(0.4)
    # capped at 0.1 s a pause: a 0.1, b 0.2 (x; y 0.1) + 0.05, c 0.1
    assert think_bound(trace, 1, 0.1) == pytest.approx(0.45)
    assert think_bound(trace, 2, 0) == 0.0
    with pytest.raises(ConfigError, match="concurrency must be positive"):
        think_bound(trace, 0, 1.0)


def test_no_replay_is_faster_than_its_think_bound():
    trace = think_trace()
    for concurrency in (1, 2):
        result = replay(trace, FakeAdapter(), concurrency=concurrency, max_think=5.0)
        bound = think_bound(trace, concurrency, 5.0)
        # an engine that takes no time lands on the bound; a schedule unlike the replay's
        # (c=1 0.9 s, c=2 0.5 s; subagents one after another: +0.3 s) would miss it
        assert bound <= result.wall_time < bound + 0.25
