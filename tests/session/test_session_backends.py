"""The Session API on both engine backends (``session_engine``: agentx's engine and the vLLM
backend): turns, typed events, forks and join, tools, streamed tool results, cancellation,
constraints, hints and errors. Where the backends differ the test reads it from
``capabilities()``: agentx holds a turn's KV exactly, vLLM's prefix cache holds whole blocks.
Prompts differ from test_session.py's: the engines are shared, and a prompt another test already
sent would hit that test's cached blocks (a longer hit than the held turn's)."""

import contextlib
import importlib.util

import anyio
import pytest

from agentx import (
    ConfigError,
    InvalidRequestError,
    PromptTooLongError,
    RequestOptions,
    SamplingParams,
    Session,
    SessionClosedError,
    TurnInProgressError,
    UnknownToolCallError,
    VLLMConfig,
    VLLMEngine,
)
from agentx.engine.backend import EngineBackend
from tests.helpers.idle import wait_idle
from tests.helpers.tools import TOOL_PROMPTS, City, add, ship, tag

pytestmark = pytest.mark.slow

SHORT = SamplingParams(max_tokens=12)


def hit(engine, num_tokens: int) -> int:
    """Tokens of a held ``num_tokens`` the next request reuses on this backend."""
    caps = engine.capabilities()
    return num_tokens if caps.exact_held_kv else num_tokens // caps.block_size * caps.block_size


def prompt_ids(session):
    ctx = session._context
    return ctx.token_ids[: ctx.last_prompt_len]


async def cold_text(engine, prompt, sampling):
    """The greedy text of ``prompt`` computed from scratch (a salt no one else uses)."""
    stream = engine.add_request(
        prompt, sampling, options=RequestOptions(cache_salt=f"cold-{id(prompt)}")
    )
    async for _ in stream:
        pass
    assert stream.final.num_cached_tokens == 0
    return stream.text


async def test_stream_and_generate_on_every_backend(session_engine):
    """The loop-thread plumbing both backends share (engine/loop_backend.py): ``stream()``
    yields a request's deltas until the final one, and leaving it early aborts the request;
    ``generate`` runs a batch to completion in prompt order."""
    engine = session_engine
    sampling = SamplingParams(max_tokens=5, ignore_eos=True)
    outs = [out async for out in engine.stream("Name three colours:", sampling)]
    assert [out.finished for out in outs] == [False] * (len(outs) - 1) + [True]
    assert sum(len(out.new_token_ids) for out in outs) == 5

    before = wait_idle(engine).num_generated_tokens
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    async with contextlib.aclosing(engine.stream("Tell a very long story:", long)) as stream:
        async for out in stream:
            assert not out.finished
            break
    after = wait_idle(engine)  # the abort reached the loop: nothing live, far from 400 tokens
    assert engine.get_num_live_requests() == 0
    assert after.num_generated_tokens - before < 400

    gens = engine.generate(["One, two,", [1, 2, 3]], sampling)
    assert [len(g.token_ids) for g in gens] == [5, 5]
    assert gens[0].prompt_token_ids != gens[1].prompt_token_ids == [1, 2, 3]


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vllm is installed in this venv"
)
def test_vllm_backend_config_and_a_clear_error_without_vllm():
    with pytest.raises(ConfigError, match="sets .*enable_prefix_caching"):
        VLLMConfig(engine_args={"enable_prefix_caching": False})
    with pytest.raises(ConfigError, match="block_size"):
        VLLMConfig(block_size=0)
    config = VLLMConfig(engine_args={"tensor_parallel_size": 2})
    args = config.to_engine_args("/models/m")
    assert args["tensor_parallel_size"] == 2 and args["scheduling_policy"] == "priority"
    with pytest.raises(ConfigError, match=r"agentx\[vllm\]"):
        VLLMEngine(config)


async def test_both_backends_implement_the_interface(session_engine):
    assert isinstance(session_engine, EngineBackend)
    caps = session_engine.capabilities()
    assert caps.priority and caps.cache_salt and caps.structured_outputs and caps.fork_held
    if caps.name == "vllm":
        assert set(caps.unsupported()) >= {"pin", "tool_latency", "exact_held_kv"}


async def test_turns_continue_from_the_held_kv(session_engine):
    async with Session(session_engine, sampling=SHORT) as s:
        r1 = await s.send("Name an animal.")
        assert r1.usage.prompt_tokens == r1.usage.cached_tokens + r1.usage.computed_tokens
        previous = r1.usage.prompt_tokens + r1.usage.output_tokens
        for follow_up in ("Another animal.", "And one more animal."):
            r = await s.send(follow_up)
            # everything computed last turn is reused; its last sampled token never ran
            assert r.usage.cached_tokens == hit(session_engine, previous - 1)
            previous = r.usage.prompt_tokens + r.usage.output_tokens
        assert [m.role for m in s.messages] == ["user", "assistant"] * 3
        assert r.usage.ttft_s > 0
    stats = wait_idle(session_engine)
    assert stats.kv_num_held == 0
    session_engine.check_integrity()


async def test_stream_yields_typed_events(session_engine):
    async with Session(session_engine, sampling=SHORT) as s:
        async with s.stream("Say good morning.") as turn:
            events = [event async for event in turn]
            message = await turn.get_final_message()
    types = [e.type for e in events]
    assert types[-1] == "turn.done" and set(types[:-1]) <= {"text.delta"}
    assert "".join(e.text for e in events[:-1]) == message.content
    assert events[-1].message is message and message.finish_reason in ("stop", "length")


async def test_fork_first_turn_reuses_the_parent(session_engine):
    async with Session(session_engine, sampling=SHORT) as parent:
        r = await parent.send("Tell me about otters.")
        parent_computed = r.usage.prompt_tokens + r.usage.output_tokens - 1
        children = await parent.fork(2)
        replies = {}

        async def ask(i, child, question):
            replies[i] = await child.send(question)

        async with anyio.create_task_group() as tg:
            questions = ["And beavers?", "And seals?"]
            for i, (child, q) in enumerate(zip(children, questions, strict=True)):
                tg.start_soon(ask, i, child, q)
        for i, child in enumerate(children):
            usage = replies[i].usage
            assert usage.cached_tokens >= hit(session_engine, parent_computed)
            assert usage.computed_tokens == usage.prompt_tokens - usage.cached_tokens
            assert replies[i].content == await cold_text(session_engine, prompt_ids(child), SHORT)
        answers = await parent.join(children)
        assert answers == [replies[0].content, replies[1].content]
        assert parent.children == [] and all(c.closed for c in children)
        await parent.send()
        assert "Subagent results" in parent.messages[-2].content
    assert wait_idle(session_engine).kv_num_held == 0


async def test_tool_call_run_loop_executes_python_tools(session_engine):
    async with Session(session_engine, tools=[add], sampling=SamplingParams(max_tokens=40)) as s:
        reply = await s.run("What is 17 plus 25?", prefill="<tool_call>[", max_turns=2)
        calls = s.messages[1].tool_calls
        assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 17, "b": 25})]
        assert s.messages[2].role == "tool" and s.messages[2].content == "42"
        assert reply is s.messages[-1] and reply.role == "assistant"


async def test_streamed_tool_result_leaves_only_template_tokens(session_engine):
    tok = session_engine.tokenizer
    async with Session(session_engine, tools=[add], sampling=SamplingParams(max_tokens=40)) as s:
        reply = await s.send("What is 4 plus 5?", prefill="<tool_call>[")
        (call,) = reply.tool_calls
        async with s.tool_result(call.id) as out:
            for chunk in ["adding: ", "carrying... ", "the sum is 9"]:
                await out.write(chunk)
            num_prefilled = len(s._context.token_ids)
        nxt = await s.send()
        template = tok.encode("<|im_end|>\n<|im_start|>assistant\n")
        assert nxt.usage.prompt_tokens == num_prefilled + len(template)
        assert nxt.usage.cached_tokens == hit(session_engine, num_prefilled)
        assert s.messages[2].content == "adding: carrying... the sum is 9"


async def test_cancelled_turn_aborts_and_rolls_back(session_engine):
    long = SamplingParams(max_tokens=500, ignore_eos=True)
    async with Session(session_engine, sampling=long) as s:
        await s.send("Hi.", sampling=SHORT)
        before = (s.messages, s._context.token_ids)
        seen = 0
        with anyio.move_on_after(120) as scope:
            async with s.stream("Write a very long story.") as turn:
                async for event in turn:
                    seen += event.type == "text.delta"
                    if seen == 3:
                        scope.cancel()
        assert scope.cancel_called
        assert (s.messages, s._context.token_ids) == before
        r = await s.send("Bye.", sampling=SHORT)  # the session is usable again
        assert r.finish_reason in ("stop", "length")
    stats = wait_idle(session_engine)
    assert stats.kv_num_held == 0
    session_engine.check_integrity()


async def test_constrained_turns_parse_and_validate(session_engine):
    sampling = SamplingParams(max_tokens=64)
    async with Session(session_engine, tools=[ship, tag, add], sampling=sampling) as s:
        reply = await s.send(TOOL_PROMPTS[2], tool_choice="required")
        assert reply.content == "" and reply.tool_calls and reply.finish_reason == "stop"
        for call in reply.tool_calls:
            assert call.ok, call.error
            await s.tools[call.name].invoke(call.arguments)  # raises if invalid
        for call in reply.tool_calls:
            s.add_tool_result(call.id, "ok")
        named = await s.send(TOOL_PROMPTS[1], tool_choice={"name": "tag"})
        assert {c.name for c in named.tool_calls} == {"tag"} and all(c.ok for c in named.tool_calls)
    async with Session(session_engine, sampling=sampling) as s:
        reply = await s.send("Describe Paris as JSON.", response_format=City)
        assert reply.finish_reason == "stop" and reply.parse_error is None
        assert reply.parsed == City.model_validate_json(reply.content)
    wait_idle(session_engine)
    session_engine.check_integrity()


async def test_misuse_and_bad_input_raise_clear_errors(session_engine):
    s = Session(session_engine, sampling=SHORT)
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
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        session_engine.add_request([1, 2, 10**9], SHORT)
    with pytest.raises(PromptTooLongError):
        session_engine.add_request([1] * session_engine.max_model_len, SHORT)
    with pytest.raises(InvalidRequestError, match="empty"):
        session_engine.add_request([], SHORT)
    assert wait_idle(session_engine).kv_num_held == 0
