"""Reliability of the Session API on the real default model: a turn that finished but was not
committed, a session closed mid-turn, bad and oversized tool results, hung tools. Each test
asserts nothing is left held in the engine afterwards."""

import threading
import time

import anyio
import pytest
from pydantic import BaseModel

from agentx import (
    InvalidRequestError,
    PromptTooLongError,
    RequestAbortedError,
    RequestFailedError,
    SamplingParams,
    Session,
    SessionClosedError,
    SessionError,
    UnknownToolCallError,
)
from agentx.engine.structured import GrammarMatcher, StructuredOutput
from agentx.session.messages import ToolCall
from agentx.session.tool_exec import execute_call
from agentx.session.tools import Tool
from tests.helpers.idle import wait_idle

pytestmark = pytest.mark.slow

SHORT = SamplingParams(max_tokens=8)
LONG = SamplingParams(max_tokens=200, ignore_eos=True)


async def wait_finished(stream, timeout=20.0):
    """Wait until the engine finished the request (its last delta is queued, maybe unread)."""
    with anyio.fail_after(timeout):
        while not (stream.finished or any(out.finished for out in list(stream._items))):
            await anyio.sleep(0.01)


def open_call(session: Session, call_id: str = "call_1") -> str:
    session._open_calls[call_id] = ToolCall(id=call_id, name="probe")
    return call_id


async def test_break_after_the_request_finished_releases_its_held_kv(default_engine):
    async with Session(default_engine, sampling=SHORT) as s:
        async with s.stream("Name a color.") as turn:
            async for _ in turn:
                await wait_finished(turn._stream)  # the engine holds its KV now
                break  # ... and the turn never reaches TurnDone: not committed
        assert s.messages == [] and s._held_kv is None
        stats = wait_idle(default_engine)
        assert stats.kv_num_held == 0 and stats.kv_num_used_blocks == 0
        reply = await s.send("Name a color.")  # the session is usable again
        assert reply.finish_reason in ("stop", "length")
    default_engine.check_integrity()
    assert wait_idle(default_engine).kv_num_held == 0


async def test_failed_streamed_tool_result_releases_the_finished_chunk(default_engine):
    async with Session(default_engine, sampling=SHORT) as s:
        await s.send("Hi.")
        call_id = open_call(s)
        with pytest.raises(RuntimeError, match="tool died"):
            async with s.tool_result(call_id) as out:
                await out.write("partial output ")
                await wait_finished(out._inflight)  # its prefill finished: KV held
                raise RuntimeError("tool died")
        assert call_id in s._open_calls  # rolled back: the call can still be answered
    stats = wait_idle(default_engine)
    assert stats.kv_num_held == 0 and stats.kv_num_used_blocks == 0
    default_engine.check_integrity()


async def test_close_during_a_pinned_turn_leaks_nothing(default_engine):
    s = Session(default_engine, sampling=LONG)
    await s.__aenter__()
    s.hint(pin=True)
    with pytest.raises((RequestAbortedError, SessionClosedError)):
        async with s.stream("Tell a long story.") as turn:
            async for _ in turn:
                await s.close()  # from inside the turn: the turn is aborted with it
    assert s.closed
    stats = wait_idle(default_engine)
    assert stats.kv_num_held == 0 and stats.kv_num_used_blocks == 0
    default_engine.check_integrity()


async def test_close_after_the_request_finished_but_before_commit(default_engine):
    s = Session(default_engine, sampling=SHORT)
    await s.__aenter__()
    s.hint(pin=True)
    with pytest.raises(SessionClosedError):
        async with s.stream("Name a color.") as turn:
            await wait_finished(turn._stream)
            await s.close()
            await turn.get_final_message()  # the commit finds the session closed
    stats = wait_idle(default_engine)
    assert stats.kv_num_held == 0 and stats.kv_num_used_blocks == 0


async def test_bad_tool_result_keeps_the_call_open(default_engine):
    async with Session(default_engine, sampling=SHORT) as s:
        await s.send("Hi.")
        call_id = open_call(s)
        with pytest.raises(InvalidRequestError):
            s.add_tool_result(call_id, 5)
        with pytest.raises(InvalidRequestError):
            s.add_tool_result(call_id, "x", is_error="yes")
        with pytest.raises(UnknownToolCallError):
            s.add_tool_result(["not", "an", "id"], "x")
        assert s._pending == [] and call_id in s._open_calls
        s.add_tool_result(call_id, "fine")
        assert s._pending == [{"role": "tool", "content": "fine"}]
        assert s.messages[-1].content == "fine"


async def test_oversized_tool_result_does_not_wedge_the_session(default_engine):
    async with Session(default_engine, sampling=SHORT) as s:
        await s.send("Hi.")
        call_id = open_call(s)
        with pytest.raises(PromptTooLongError, match="call stays open"):
            s.add_tool_result(call_id, "word " * 10_000)
        assert call_id in s._open_calls and s._pending == []
        s.add_tool_result(call_id, "short result")
        reply = await s.send()
        assert reply.finish_reason in ("stop", "length")


async def test_hung_sync_tool_times_out_and_cancels():
    release = threading.Event()

    def hang() -> str:
        """Never returns on its own."""
        release.wait(30)
        return "late"

    tools = {"hang": Tool.from_function(hang)}
    call = ToolCall(id="c", name="hang")
    try:
        t0 = time.monotonic()
        content, is_error = await execute_call(tools, call, timeout=0.3)
        assert is_error and "did not finish within 0.3 s" in content
        with anyio.move_on_after(0.3) as scope:  # no timeout: the caller cancels
            await execute_call(tools, call)
        assert scope.cancelled_caught
        assert time.monotonic() - t0 < 5.0
    finally:
        release.set()


async def test_run_loop_with_a_hung_tool_finishes(default_engine):
    release = threading.Event()

    def add(a: int, b: int) -> int:
        """Add two integers."""
        release.wait(30)
        return a + b

    sampling = SamplingParams(max_tokens=40)
    try:
        async with Session(default_engine, tools=[add], sampling=sampling) as s:
            t0 = time.monotonic()
            await s.run(
                "What is 17 plus 25?", prefill="<tool_call>[", max_turns=2, tool_timeout=0.3
            )
            assert time.monotonic() - t0 < 20.0
            assert s.messages[2].role == "tool" and s.messages[2].is_error
            assert "did not finish" in s.messages[2].content
    finally:
        release.set()
    assert wait_idle(default_engine).kv_num_held == 0


async def test_a_session_dropped_without_close_releases_its_kv(default_engine):
    import gc

    s = Session(default_engine, sampling=SHORT)
    await s.send("Name a color.")
    s.hint(pin=True)
    await s.send("Another.")
    children = await s.fork(2)
    assert wait_idle(default_engine).kv_num_held == 3
    del s, children  # abandoned: never closed
    gc.collect()
    deadline = time.monotonic() + 20
    while default_engine.stats().kv_num_held and time.monotonic() < deadline:
        time.sleep(0.02)  # the loop releases them when it wakes
    stats = wait_idle(default_engine)
    assert stats.kv_num_held == 0 and stats.kv_num_used_blocks == 0
    default_engine.check_integrity()


@pytest.fixture
def grammar_fails_at_run_time(monkeypatch):
    """Every constrained request's matcher fails on its second committed token (as llguidance
    does past one of its limits): what no check at submit could see."""
    commit = GrammarMatcher.commit

    def failing(self, token_id):
        self.num_committed = getattr(self, "num_committed", 0) + 1
        token_id = commit(self, token_id)
        if self.num_committed == 2:
            self.failed = True
        return token_id

    monkeypatch.setattr(GrammarMatcher, "commit", failing)


async def test_a_run_time_failure_is_an_error_on_every_surface(
    default_engine, grammar_fails_at_run_time
):
    class Person(BaseModel):
        name: str

    constrained = SamplingParams(
        max_tokens=16, structured=StructuredOutput(json_schema=Person.model_json_schema())
    )
    with pytest.raises(RequestFailedError, match="grammar_error") as info:
        default_engine.generate(["Name a person:"], constrained)
    assert info.value.output.finish_reason == "error"  # was: a Generation, and no exception
    deltas = []
    with pytest.raises(RequestFailedError):
        async for out in default_engine.stream("Name a person:", constrained):
            deltas.append(out)
    assert sum(len(d.new_token_ids) for d in deltas) == 1  # the delta before the failure
    async with Session(default_engine, sampling=SHORT) as s:
        with pytest.raises(RequestFailedError):  # was: a reply with parsed=None
            await s.send("Name a person.", response_format=Person)
        assert s.messages == []  # the turn rolled back
    stats = wait_idle(default_engine)
    assert stats.kv_num_held == 0 and stats.kv_num_used_blocks == 0


async def test_join_refuses_a_session_that_is_not_its_child(default_engine):
    async with Session(default_engine, sampling=SHORT) as parent:
        await parent.send("Hi.")
        child = await parent.fork()
        grandchild = await child.fork()
        async with Session(default_engine, sampling=SHORT) as stranger:
            for others in ([stranger], [child, grandchild]):
                with pytest.raises(SessionError, match="not"):  # was: joined and closed
                    await parent.join(others)
            assert not stranger.closed and not child.closed and not grandchild.closed
            assert parent.children == [child]
            last = parent.messages[-1].content  # what the child inherited is its answer
            assert await parent.join([child]) == [last]  # its own child still joins
            assert child.closed and grandchild.closed
    stats = wait_idle(default_engine)
    assert stats.kv_num_held == 0 and stats.kv_num_used_blocks == 0


async def test_a_huge_tool_result_is_refused_at_once(default_engine):  # issue 36.3
    async with Session(default_engine, sampling=SHORT) as s:
        await s.send("Hi.")
        call_id = open_call(s)
        started = time.perf_counter()
        with pytest.raises(PromptTooLongError, match="call stays open"):
            s.add_tool_result(call_id, "lorem ipsum dolor sit amet " * 400_000)  # 10.8 MB
        assert time.perf_counter() - started < 0.5  # was: seconds of tokenizing first
        assert call_id in s._open_calls and s._pending == []


async def test_a_huge_message_leaves_the_event_loop_running(default_engine):  # issue 36.3
    """A message too long for any tokenization is refused before tokenizing; one that could
    fit is rendered and tokenized in a worker thread while a ticker keeps ticking."""
    tokenizer = default_engine.tokenizer
    longest = max(len(p) for p in tokenizer.backend.get_vocab(with_added_tokens=True))
    # the longest text the character bound lets through: it is tokenized, then refused
    fits_bound = "lorem ipsum dolor sit amet " * (longest * default_engine.max_model_len // 14)
    gaps, done = [], anyio.Event()

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await anyio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with anyio.create_task_group() as group:
        group.start_soon(ticker)
        async with Session(default_engine, sampling=SHORT) as s:
            started = time.perf_counter()
            with pytest.raises(PromptTooLongError, match="characters"):
                await s.send("lorem ipsum dolor sit amet " * 200_000)  # 5.4 MB
            assert time.perf_counter() - started < 0.5
            with pytest.raises(PromptTooLongError):
                await s.send(fits_bound)
            assert s.messages == [] and s._turn is None  # rolled back
            reply = await s.send("Name a color.")  # usable again
            assert reply.finish_reason in ("stop", "length")
        done.set()
    assert len(gaps) > 10 and max(gaps) < 0.2
    assert wait_idle(default_engine).kv_num_held == 0
