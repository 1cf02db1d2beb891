"""The Session API end to end on the real default model: turns extend held KV, forks compute
only their new tokens, streamed tool results, tools, cancellation, errors, hints."""

import anyio
import pytest

from agentx import (
    CacheConfig,
    SamplingParams,
    SchedulerConfig,
    Session,
    SessionClosedError,
    SpeculativeConfig,
    TurnInProgressError,
    UnknownToolCallError,
)
from agentx.session.default import get_default_engine
from tests.helpers.idle import wait_idle

pytestmark = pytest.mark.slow

SHORT = SamplingParams(max_tokens=12)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def prompt_ids(session):
    ctx = session._context
    return ctx.token_ids[: ctx.last_prompt_len]


async def test_turns_continue_from_the_held_kv(default_engine):
    async with Session(default_engine, sampling=SHORT) as s:
        r1 = await s.send("Name a color.")
        assert r1.usage.cached_tokens < r1.usage.prompt_tokens  # its last token always runs
        assert r1.usage.prompt_tokens == r1.usage.cached_tokens + r1.usage.computed_tokens
        previous = r1.usage.prompt_tokens + r1.usage.output_tokens
        for follow_up in ("Another one.", "And one more."):
            r = await s.send(follow_up)
            # everything computed last turn is reused; its last sampled token never ran
            assert r.usage.cached_tokens == previous - 1
            previous = r.usage.prompt_tokens + r.usage.output_tokens
        assert [m.role for m in s.messages] == ["user", "assistant"] * 3
        assert r.usage.ttft_s > 0 and r.usage.output_tokens_per_s > 0
    stats = wait_idle(default_engine)
    assert stats.kv_num_held == 0 and stats.kv_num_used_blocks == 0
    default_engine.check_integrity()


async def test_stream_yields_typed_events(default_engine):
    async with Session(default_engine, sampling=SHORT) as s:
        async with s.stream("Say hello.") as turn:
            events = [event async for event in turn]
            message = await turn.get_final_message()
    types = [e.type for e in events]
    assert types[-1] == "turn.done" and set(types[:-1]) <= {"text.delta"}
    assert "".join(e.text for e in events[:-1]) == message.content
    assert events[-1].message is message and events[-1].usage == message.usage


async def test_fork_first_turn_computes_only_its_new_tokens(default_engine, make_engine_module):
    cold = make_engine_module(
        cache=CacheConfig(kv_cache_bytes=64 << 20, enable_prefix_caching=False)
    )
    async with Session(default_engine, sampling=SHORT) as parent:
        r = await parent.send("Tell me about cats.")
        parent_computed = r.usage.prompt_tokens + r.usage.output_tokens - 1
        children = await parent.fork(2)
        replies = {}

        async def ask(i, child, question):
            replies[i] = await child.send(question)

        async with anyio.create_task_group() as tg:
            for i, (child, q) in enumerate(zip(children, ["And dogs?", "And birds?"], strict=True)):
                tg.start_soon(ask, i, child, q)
        for i, child in enumerate(children):
            usage = replies[i].usage
            # the held fork covers the parent exactly; a sibling running alongside may already
            # have published the next full block, which is a longer (prefix-cache) hit
            assert usage.cached_tokens >= parent_computed
            assert usage.computed_tokens == usage.prompt_tokens - usage.cached_tokens
            expected = cold.generate([prompt_ids(child)], SHORT)[0].text
            assert replies[i].content == expected
        assert min(replies[i].usage.cached_tokens for i in range(2)) == parent_computed
        child_usage = replies[0].usage + replies[1].usage
        assert parent.total_usage.output_tokens == r.usage.output_tokens + child_usage.output_tokens
        answers = await parent.join(children)
        assert answers == [replies[0].content, replies[1].content]
        assert parent.children == [] and all(c.closed for c in children)
        await parent.send()  # the joined answers go out as the next user message
        assert "Subagent results" in parent.messages[-2].content
    assert wait_idle(default_engine).kv_num_used_blocks == 0


async def test_tool_call_run_loop_executes_python_tools(default_engine):
    async with Session(default_engine, tools=[add], sampling=SamplingParams(max_tokens=40)) as s:
        reply = await s.run("What is 17 plus 25?", prefill="<tool_call>[", max_turns=2)
        calls = s.messages[1].tool_calls
        assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 17, "b": 25})]
        tool_message = s.messages[2]
        assert tool_message.role == "tool" and tool_message.content == "42"
        assert tool_message.tool_call_id == calls[0].id
        assert reply is s.messages[-1] and reply.role == "assistant"


async def test_streamed_tool_result_leaves_only_template_tokens(default_engine):
    tok = default_engine.tokenizer
    async with Session(default_engine, tools=[add], sampling=SamplingParams(max_tokens=40)) as s:
        reply = await s.send("What is 2 plus 3?", prefill="<tool_call>[")
        (call,) = reply.tool_calls
        async with s.tool_result(call.id) as out:
            for chunk in ["partial result: ", "still working... ", "the sum is 5"]:
                await out.write(chunk)
        nxt = await s.send()
        template = tok.encode("<|im_end|>\n<|im_start|>assistant\n")
        assert nxt.usage.computed_tokens == len(template)
        assert s.messages[2].content == "partial result: still working... the sum is 5"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_cancelled_turn_aborts_and_rolls_back(default_engine, backend):
    async def main():
        async with Session(
            default_engine, sampling=SamplingParams(max_tokens=500, ignore_eos=True)
        ) as s:
            await s.send("Hi.", sampling=SHORT)
            before = (s.messages, s._context.token_ids)
            seen = 0
            with anyio.move_on_after(60) as scope:
                async with s.stream("Write a very long story.") as turn:
                    async for event in turn:
                        seen += event.type == "text.delta"
                        if seen == 3:
                            scope.cancel()
            assert scope.cancel_called
            assert (s.messages, s._context.token_ids) == before
            r = await s.send("Bye.", sampling=SHORT)  # the session is usable again
            assert r.finish_reason in ("stop", "length")

    anyio.run(main, backend=backend)
    stats = wait_idle(default_engine)
    assert stats.kv_num_used_blocks == 0 and stats.kv_num_held == 0
    default_engine.check_integrity()


async def test_misuse_raises_clear_errors(default_engine):
    s = Session(default_engine, sampling=SHORT)
    async with s.stream("One.") as turn:
        with pytest.raises(TurnInProgressError):
            async with s.stream("Two."):
                pass
        await turn.get_final_message()
    with pytest.raises(UnknownToolCallError):
        s.add_tool_result("call_nope", "x")
    child = await s.fork()
    await s.close()
    assert child.closed
    with pytest.raises(SessionClosedError):
        await s.send("after close")
    with pytest.raises(SessionClosedError):
        await child.send("child after parent closed")
    assert wait_idle(default_engine).kv_num_held == 0


async def test_hints_priority_pin_release(make_engine):
    # drafting off: a's decode must outlast the arrivals of b and c (drafts can finish it early)
    engine = make_engine(
        scheduler=SchedulerConfig(max_num_seqs=1), speculative=SpeculativeConfig(enabled=False)
    )
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    a, b, c = (Session(engine, sampling=sampling) for _ in range(3))
    b.hint(priority=-1)
    c.hint(priority=5)
    order = []

    async def waiting(n):  # arrivals are ordered by the queue, not by wall-clock sleeps
        while engine.stats().num_waiting < n:
            await anyio.sleep(0.01)

    async def turn(name, s, after):
        await after()
        # a decodes 256 tokens: b and c arrive while it holds the only running slot
        length = SamplingParams(max_tokens=256, ignore_eos=True) if name == "a" else None
        await s.send(f"Session {name}.", sampling=length)
        order.append(name)

    async def running():
        while engine.stats().num_running < 1:
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(turn, "a", a, anyio.lowlevel.checkpoint)
        tg.start_soon(turn, "c", c, running)  # both wait while a runs: b (-1) goes before c (5)
        tg.start_soon(turn, "b", b, lambda: waiting(1))
    assert order == ["a", "b", "c"]
    a.hint(pin=True)
    wait_idle(engine)
    assert engine.core.kv.held.get(a._held_kv).pinned
    b.hint(release=True)
    cached_before = engine.stats().kv_num_cached_blocks
    await b.close()
    # b's blocks were dropped from the cache (a's and c's, released below, stay cached: their
    # partial last blocks too)
    assert wait_idle(engine).kv_num_cached_blocks < cached_before
    await a.close()
    await c.close()
    stats = wait_idle(engine)
    assert stats.kv_num_used_blocks == 0


def test_session_without_arguments_uses_the_shared_default_engine():
    async def main():
        async with Session(sampling=SHORT) as s:
            reply = await s.send("Hi!")
            assert s.engine is get_default_engine()
            return reply

    for backend in ("asyncio", "trio"):
        assert anyio.run(main, backend=backend).finish_reason in ("stop", "length")
