"""The bad-input sweep: every public entry point driven with hypothesis.

Wrong types, negative and huge numbers, NaN, empty and oversized prompts, lone surrogates,
token ids out of range, invalid schemas and grammars, unknown tool-call ids, a second
concurrent turn and calls after close: each either works or raises a documented error from
``agentx.errors`` (never a TypeError, a KeyError, a crash of the engine loop), and afterwards
the engine serves the next request exactly as before. Example counts are kept small (the module
runs in well under a minute on one core); the shared default engine serves every property.
"""

import json
import math

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentx import SamplingParams, Session
from agentx.bench.loader import load_trace
from agentx.engine.hints import BranchPoint, Pin, Priority, Release, ToolLatency, TurnsLeft
from agentx.engine.structured import StructuredOutput
from agentx.errors import (
    AgentXError,
    InvalidRequestError,
    RequestFailedError,
    SamplingParamsError,
    SessionClosedError,
    TraceError,
    TurnInProgressError,
    UnknownToolCallError,
)
from agentx.session.messages import ToolCall
from agentx.session.tools import Tool

pytestmark = pytest.mark.slow

FAST = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,  # the same examples every run: a failure reproduces
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ONE_TOKEN = SamplingParams(max_tokens=1)
REFERENCE_PROMPT = "The capital of France is"

# anything a caller might pass where a value is expected
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=4),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
# text with lone surrogates, NULs, control characters, private use, emoji
any_text = st.one_of(
    st.text(
        st.characters(codec=None, categories=["Cs", "Cc", "Co", "Lu", "Ll", "Nd", "So", "Zs"]),
        max_size=40,
    ),
    st.sampled_from(["\ud800", "tail \udfff", "\x00", "\ufeff", "😀" * 50]),
)


@pytest.fixture(scope="module")
def reference(default_engine):
    """The greedy reply every property checks the engine still gives."""
    out = default_engine.add_request(REFERENCE_PROMPT, SamplingParams(max_tokens=8)).result()
    return out.token_ids


def assert_serves(engine, reference):
    out = engine.add_request(REFERENCE_PROMPT, SamplingParams(max_tokens=8)).result(timeout=60)
    assert out.token_ids == reference
    engine.check_integrity()


def settle(engine, stream):
    """Run an accepted request to its end; release what it held."""
    stream.result(timeout=60)
    engine.release_held(stream.request_id)


# ---- SamplingParams --------------------------------------------------------------------------

SAMPLING_FIELDS = [
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "structured",
]


@FAST
@given(st.dictionaries(st.sampled_from(SAMPLING_FIELDS), junk, max_size=3))
def test_sampling_params_accept_or_raise_sampling_params_error(fields):
    try:
        params = SamplingParams(**fields)
    except SamplingParamsError:
        return
    t = params.temperature
    assert t == 0 or (math.isfinite(t) and t >= 1e-5)
    assert isinstance(params.max_tokens, int) and params.max_tokens > 0
    assert 0 < params.top_p <= 1


# ---- prompts and request options on the engine -------------------------------------------------

prompts = st.one_of(
    any_text,
    st.just(""),
    st.just("word " * 9000),  # longer than the model context
    st.lists(
        st.one_of(st.integers(min_value=-5, max_value=60_000), st.booleans(), st.floats()),
        max_size=6,
    ),
)


@settings(FAST, max_examples=30)
@given(prompt=prompts)
def test_bad_prompts_raise_invalid_request(default_engine, reference, prompt):
    try:
        stream = default_engine.add_request(prompt, ONE_TOKEN)
    except InvalidRequestError:
        return
    out = stream.result(timeout=60)
    assert out.finish_reason in ("stop", "length") and len(out.token_ids) == 1


OPTION_FIELDS = ["priority", "cache_salt", "hold_kv", "held_kv", "hints"]
hint_values = st.one_of(junk, st.lists(st.one_of(junk, st.builds(Pin)), max_size=2))


@settings(FAST, max_examples=30)
@given(st.dictionaries(st.sampled_from(OPTION_FIELDS), hint_values, min_size=1, max_size=3))
def test_bad_request_options_never_reach_the_loop(default_engine, fields):
    try:
        stream = default_engine.add_request("Hi", ONE_TOKEN, **fields)
    except InvalidRequestError:
        return
    settle(default_engine, stream)


def test_engine_still_serves_after_the_request_sweeps(default_engine, reference):
    assert_serves(default_engine, reference)
    assert default_engine.stats().kv_num_held == 0


# ---- hints ---------------------------------------------------------------------------------------

HINTS = [ToolLatency, BranchPoint, TurnsLeft, Priority, Pin, Release]
HINT_KEYWORDS = ["tool_latency", "branch", "turns_left", "priority", "pin", "release", "bogus"]


@FAST
@given(st.sampled_from(HINTS), junk)
def test_hint_records_accept_or_raise_invalid_request(kind, value):
    try:
        hint = kind(value)
    except InvalidRequestError:
        return
    if kind is ToolLatency:
        assert math.isfinite(hint.seconds) and hint.seconds >= 0


@FAST
@given(st.dictionaries(st.sampled_from(HINT_KEYWORDS), junk, min_size=1, max_size=2))
def test_session_hints_accept_or_raise_invalid_request(default_engine, keywords):
    session = Session(default_engine)
    try:
        session.hint(**keywords)
    except InvalidRequestError:
        pass


# ---- structured output ---------------------------------------------------------------------------

schemas = st.one_of(
    junk,
    st.recursive(
        st.dictionaries(
            st.sampled_from(["type", "properties", "items", "enum", "required", "pattern"]),
            st.one_of(st.sampled_from(["object", "string", "integer", "nope"]), st.integers()),
            max_size=3,
        ),
        lambda inner: st.dictionaries(st.sampled_from(["properties", "items"]), inner, max_size=2),
        max_leaves=4,
    ),
    st.text(max_size=12),
    st.dictionaries(st.one_of(st.text(max_size=4), st.integers()), junk, max_size=3),
    st.lists(st.one_of(st.text(max_size=4), junk), max_size=3),
)
STRUCTURED_FIELDS = st.sampled_from(["json_schema", "regex", "choice", "grammar"])


@settings(FAST, max_examples=60)
@given(st.dictionaries(STRUCTURED_FIELDS, schemas, min_size=1, max_size=2))
def test_structured_output_accepts_or_raises_invalid_request(default_engine, fields):
    try:
        spec = StructuredOutput(**fields)
        sampling = SamplingParams(max_tokens=4, structured=spec)
        stream = default_engine.add_request("Answer:", sampling)
    except InvalidRequestError:
        return
    try:
        out = stream.result(timeout=60)
    except RequestFailedError:  # failed while it ran: an error, never a quiet "stop"
        return
    assert out.finish_reason in ("stop", "length")


# ---- sessions and tools --------------------------------------------------------------------------

messages = st.one_of(
    any_text,
    junk,
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "nope"]), "content": junk}),
)


@settings(FAST, max_examples=20)
@given(message=messages)
def test_session_messages_work_or_raise_documented_errors(default_engine, message):
    async def main():
        async with Session(default_engine, sampling=ONE_TOKEN) as s:
            try:
                await s.send(message)
            except InvalidRequestError:
                assert s.messages == []  # rolled back, and usable again
            reply = await s.send("Hi")
            assert reply.finish_reason in ("stop", "length")

    anyio.run(main)


@settings(FAST, max_examples=30)
@given(call_id=junk, content=st.one_of(junk, any_text), is_error=junk)
def test_tool_results_take_only_open_calls(default_engine, call_id, content, is_error):
    s = Session(default_engine)
    s._ensure_context()
    s._open_calls["call_ok"] = ToolCall(id="call_ok", name="probe")
    try:
        s.add_tool_result(call_id, content, is_error)
    except (UnknownToolCallError, InvalidRequestError):
        assert "call_ok" in s._open_calls and s._pending == []  # nothing half-taken
        return
    raise AssertionError(f"accepted a result for {call_id!r}")


def probe(a: int, b: str = "x") -> str:
    """A tool with typed arguments."""
    return f"{a}{b}"


@FAST
@given(st.dictionaries(st.sampled_from(["a", "b", "c"]), junk, max_size=3))
def test_tool_arguments_validate_or_raise_invalid_request(arguments):
    tool = Tool.from_function(probe)

    async def main():
        try:
            return await tool.invoke(arguments)
        except InvalidRequestError:
            return None

    result = anyio.run(main)
    assert result is None or isinstance(result, str)


@settings(FAST, max_examples=20)
@given(junk)
def test_session_tools_accept_or_raise_invalid_request(default_engine, tools):
    try:
        Session(default_engine, tools=tools if isinstance(tools, list) else [tools])
    except InvalidRequestError:
        pass


async def test_misuse_raises_session_errors(default_engine, reference):
    s = Session(default_engine, sampling=ONE_TOKEN)
    async with s.stream("One.") as turn:
        with pytest.raises(TurnInProgressError):
            await s.send("Two.")
        with pytest.raises(TurnInProgressError):
            s.add_tool_result("call_x", "y")
        await turn.get_final_message()
    with pytest.raises(UnknownToolCallError):
        s.add_tool_result("call_never_made", "y")
    await s.close()
    for call in (lambda: s.send("after"), lambda: s.fork(2)):
        with pytest.raises(SessionClosedError):
            await call()
    with pytest.raises(SessionClosedError):
        s.hint(pin=True)
    assert_serves(default_engine, reference)


# ---- bench trace loaders -------------------------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
trace_keys = st.sampled_from(["id", "requests", "type", "t", "in", "out", "hash_ids", "subagent"])
trace_like = st.dictionaries(trace_keys, json_values, max_size=4)


@settings(FAST, max_examples=60)
@given(
    body=st.one_of(
        st.binary(max_size=64),
        json_values.map(lambda v: json.dumps(v).encode()),
        trace_like.map(lambda v: json.dumps(v).encode()),
    ),
    suffix=st.sampled_from([".json", ".jsonl"]),
)
def test_trace_loaders_load_or_raise_trace_error(tmp_path_factory, body, suffix):
    path = tmp_path_factory.mktemp("trace") / f"t{suffix}"
    path.write_bytes(body)
    try:
        load_trace(path)
    except TraceError:
        pass


def test_every_error_above_is_documented():
    import agentx.errors as errors

    for name in errors.__all__:
        assert name in errors.__doc__
    assert issubclass(InvalidRequestError, AgentXError)


def test_engine_still_serves_after_the_whole_sweep(default_engine, reference):
    assert_serves(default_engine, reference)
    stats = default_engine.stats()
    assert stats.num_running == stats.num_waiting == 0
