"""Closed-loop replay: a turn's prompt carries the ids the engine generated, exactly."""

import asyncio

from agentx.bench.adapter import Done
from agentx.bench.fake_adapter import FakeAdapter, fake_encode
from agentx.bench.prompts import PromptBuilder, TextPromptBuilder
from agentx.bench.replay import Replay, ReplayConfig
from agentx.bench.segments import Prompt
from agentx.bench.synth import SynthConfig, synthesize
from agentx.bench.trace import SessionTrace, Subagent, Trace, TraceRequest


def r(n_in, n_out, ids):
    return TraceRequest(0.0, n_in, n_out, tuple(ids))


def replay(trace, engine, prompts, loop="closed"):
    async def go():
        config = ReplayConfig(progress=False, max_think=0, loop=loop)
        rep = Replay(trace, engine, config, prompts)
        return await rep.run(await engine.start())

    return asyncio.run(go())


class RecordingAdapter(FakeAdapter):
    """The fake engine, keeping every request's output ids."""

    def __init__(self) -> None:
        super().__init__(record_prompts=True)
        self.outputs: dict[str, tuple[int, ...]] = {}

    async def generate(self, request):
        async for event in super().generate(request):
            if isinstance(event, Done):
                self.outputs[request.request_id] = event.token_ids
            yield event


def tree_trace():
    steps = (
        r(128, 3, [1, 2]),  # the next turn covers 128 + 3 tokens of it, then 61 new
        Subagent(0.0, "a", (r(150, 3, [1, 2, 10]), r(200, 3, [1, 2, 10, 11]))),
        r(192, 3, [1, 2, 3]),
        r(100, 3, [1, 7]),  # shorter than 192 + 3: a new context (compacted)
    )
    return Trace("t", 64, (SessionTrace("s", steps),))


def extends(longer, shorter):
    return longer[: len(shorter)] == shorter


def test_each_turn_extends_the_last_prompt_and_its_output_exactly():
    for prompts in (TextPromptBuilder(64), PromptBuilder(64)):
        engine = RecordingAdapter()
        result = replay(tree_trace(), engine, prompts)
        assert all(x.error is None for x in result.records)
        p, out = engine.prompts, engine.outputs
        assert all(len(out[k]) == 3 for k in p)
        assert extends(p["s#1"], p["s#0"] + list(out["s#0"]))  # the parent's next turn
        assert extends(p["s/a#0"], p["s#0"] + list(out["s#0"]))  # a subagent forks the parent
        assert extends(p["s/a#1"], p["s/a#0"] + list(out["s/a#0"]))
        assert not extends(p["s#1"], p["s/a#0"])  # the parent does not see the subagent's turns
        # compacted: built from its hash ids alone, a new context
        assert p["s#2"] == Prompt((prompts.segment("", (1, 7), 100, "s#2"),)).token_ids(fake_encode)
    # random ids: the lengths are exact
    assert len(p["s#1"]) == 192 and len(p["s/a#1"]) == 200


def test_open_loop_sends_the_trace_tokens():
    engine = RecordingAdapter()
    replay(tree_trace(), engine, PromptBuilder(64), loop="open")
    p = engine.prompts
    assert p["s#1"][:128] == p["s#0"]  # the trace's block 1, 2, not the engine's output
    assert engine.outputs["s#0"] is None  # open loop asks for no output ids
    generated = [17 + (128 * 31 + i) % 1000 for i in range(3)]  # what the fake engine produced
    assert p["s#1"][128:131] != generated


def test_a_synthesized_session_in_closed_loop():
    trace = synthesize(SynthConfig(num_sessions=2, seed=1, scale=0.02, output_scale=0.05,
                                   max_context_tokens=4096))  # fmt: skip
    engine = RecordingAdapter()
    result = replay(trace, engine, TextPromptBuilder(64))
    assert all(x.error is None for x in result.records)
    for session in trace.sessions:
        turns = [s for s in session.steps if isinstance(s, TraceRequest)]
        ids = [f"{session.session_id}#{i}" for i in range(len(turns))]
        num_extending = 0
        for k in range(1, len(turns)):
            grows = (
                turns[k].num_input_tokens
                >= turns[k - 1].num_input_tokens + turns[k - 1].num_output_tokens
            )
            if grows:
                num_extending += 1
                prev = engine.prompts[ids[k - 1]] + list(engine.outputs[ids[k - 1]])
                assert extends(engine.prompts[ids[k]], prev)
        assert num_extending >= 1


class NoIdsAdapter(FakeAdapter):
    async def generate(self, request):
        async for event in super().generate(request):
            yield Done(event.num_output, event.num_cached) if isinstance(event, Done) else event


def test_an_engine_without_output_ids_fails_closed_loop_turns():
    result = replay(tree_trace(), NoIdsAdapter(), PromptBuilder(64))
    assert all("returned no output token ids" in x.error for x in result.records)
