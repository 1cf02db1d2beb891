"""The HTTP request-body sweep (issue 36): hypothesis drives ``agentx serve``'s ASGI app.

Bodies are plausible requests with one or two fields made wrong (wrong types, missing fields,
huge, negative and NaN numbers, lone surrogates and other odd unicode, deep nesting, bad tool
schemas, bad ``response_format``, bad logprobs), or no request at all. The app is the one the
server runs (Host / content-type guard, FastAPI's own error handlers, the routes), reached
through an in-process ASGI transport. Property: every answer is a 2xx with a well-formed body
(a stream of well-formed events that ends, with no error event) or a 4xx JSON error in
OpenAI's shape; never a 5xx, never plain text, never a hang. Afterwards the engine runs no
request, holds no KV but the service's held conversations (none once they are cleared), and
``check_integrity()`` passes. Derandomized; the example counts are ``EXAMPLES`` below.
"""

import json
import math
from dataclasses import dataclass

import anyio
import httpx2
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agentx.openai import ChatService
from agentx.openai.server import create_app
from tests.helpers.idle import wait_idle
from tests.helpers.openai_api import ADD_TOOL, PERSON_FORMAT

pytestmark = pytest.mark.slow

EXAMPLES = {"chat": 300, "completions": 200, "responses": 200, "raw": 100}
SWEEP = settings(
    deadline=None,
    derandomize=True,  # the same examples every run: a failure reproduces
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
HANG_S = 120  # a request that has not answered by then is a hang, not a slow reply
JSON = {"content-type": "application/json"}

# ---- values --------------------------------------------------------------------------------

odd_text = st.one_of(
    st.text(
        st.characters(codec=None, categories=["Cs", "Cc", "Co", "Lu", "Ll", "Nd", "So", "Zs"]),
        max_size=24,
    ),
    st.sampled_from(["", "\ud800", "tail \udfff", "\x00", "\ufeff", "😀" * 40, "a" * 5000]),
)
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63), 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.5, 1e308, -0.0]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, odd_text)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(odd_text, inner, max_size=3)
    ),
    max_leaves=6,
)


@dataclass(frozen=True)
class Deep:
    """A value nested ``depth`` lists (or objects) deep, written out only when encoding (a
    Python object that deep would break hypothesis's printing of a failing example)."""

    depth: int
    objects: bool

    def to_json(self) -> str:
        if self.objects:
            return '{"a":' * self.depth + "1" + "}" * self.depth
        return "[" * self.depth + "1" + "]" * self.depth


deep = st.builds(Deep, st.sampled_from([50, 900, 5000, 100_000]), st.booleans())
values = st.one_of(junk, deep)

# ---- route-shaped wrong parts ----------------------------------------------------------------

schemas = st.one_of(
    values,
    st.fixed_dictionaries({"type": st.sampled_from(["object", "array", "nope", 3])}),
    st.just({"$ref": "#"}),  # no finite instance
    st.just({"type": "array", "minItems": 5000}),
    st.just({"type": "string", "pattern": "("}),
    st.just({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
    st.dictionaries(st.sampled_from(["type", "properties", "required", "enum", "items"]), values),
)
function_specs = st.one_of(
    values,
    st.fixed_dictionaries(
        {"name": st.one_of(odd_text, values)},
        optional={"parameters": schemas, "description": values, "strict": values},
    ),
)
bad_tools = st.one_of(
    values,
    st.lists(
        st.one_of(
            values, st.fixed_dictionaries({"type": st.just("function"), "function": function_specs})
        ),
        max_size=3,
    ),
    st.just([ADD_TOOL, ADD_TOOL]),
)
flat_tools = st.one_of(  # the Responses API's tool shape
    values,
    st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "web_search", 1])},
            optional={"name": st.one_of(odd_text, values), "parameters": schemas},
        ),
        max_size=2,
    ),
)
response_formats = st.one_of(
    values,
    st.just(PERSON_FORMAT),
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])}),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.one_of(
                values, st.fixed_dictionaries({"name": values, "schema": schemas})
            ),
        }
    ),
)
messages = st.one_of(
    values,
    st.lists(
        st.one_of(
            values,
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(
                        ["user", "system", "assistant", "tool", "developer", "x"]
                    )
                },
                optional={
                    "content": st.one_of(
                        odd_text,
                        values,
                        st.lists(
                            st.fixed_dictionaries(
                                {"type": st.sampled_from(["text", "image_url", 5]), "text": values}
                            ),
                            max_size=2,
                        ),
                    ),
                    "tool_calls": st.one_of(
                        values,
                        st.lists(
                            st.fixed_dictionaries(
                                {
                                    "id": values,
                                    "type": st.just("function"),
                                    "function": st.fixed_dictionaries(
                                        {"name": values, "arguments": st.one_of(odd_text, values)}
                                    ),
                                }
                            ),
                            max_size=2,
                        ),
                    ),
                    "tool_call_id": values,
                    "name": values,
                },
            ),
        ),
        max_size=3,
    ),
)
prompts = st.one_of(
    values,
    odd_text,
    st.lists(st.integers(min_value=-3, max_value=200_000), max_size=5),
    st.lists(st.lists(st.integers(min_value=-3, max_value=60_000), max_size=3), max_size=2),
    st.lists(st.one_of(odd_text, st.booleans(), st.floats()), max_size=3),
)
input_items = st.one_of(
    values,
    odd_text,
    st.lists(
        st.one_of(
            values,
            st.fixed_dictionaries(
                {
                    "type": st.sampled_from(
                        ["message", "function_call", "function_call_output", "x"]
                    )
                },
                optional={
                    "role": st.sampled_from(["user", "assistant", "system", "x"]),
                    "content": st.one_of(odd_text, values),
                    "call_id": values,
                    "name": values,
                    "arguments": values,
                    "output": values,
                },
            ),
        ),
        max_size=3,
    ),
)
logprob_values = st.one_of(values, st.integers(min_value=-3, max_value=30))

COMMON = {
    "model": st.one_of(odd_text, values, st.just("not-served")),
    "temperature": values,
    "top_p": values,
    "top_k": values,
    "seed": values,
    "stop": st.one_of(values, st.lists(odd_text, max_size=6)),
    "stream": values,
    "stream_options": st.one_of(values, st.fixed_dictionaries({"include_usage": values})),
    "user": values,
    "prompt_cache_key": values,
}
FIELDS = {
    "chat": {
        **COMMON,
        "messages": messages,
        "max_tokens": values,
        "max_completion_tokens": values,
        "n": values,
        "tools": bad_tools,
        "tool_choice": st.one_of(
            values,
            st.sampled_from(["auto", "none", "required", "sometimes"]),
            st.fixed_dictionaries(
                {"type": st.just("function"), "function": st.fixed_dictionaries({"name": values})}
            ),
        ),
        "response_format": response_formats,
        "logprobs": logprob_values,
        "top_logprobs": logprob_values,
        "parallel_tool_calls": values,
        "logit_bias": values,
        "metadata": values,
    },
    "completions": {
        **COMMON,
        "prompt": prompts,
        "max_tokens": values,
        "n": values,
        "echo": values,
        "suffix": values,
        "logprobs": logprob_values,
        "best_of": values,
    },
    "responses": {
        **COMMON,
        "input": input_items,
        "instructions": values,
        "max_output_tokens": values,
        "tools": flat_tools,
        "tool_choice": values,
        "text": st.one_of(values, st.fixed_dictionaries({"format": response_formats})),
        "previous_response_id": values,
        "store": values,
        "reasoning": values,
        "top_logprobs": logprob_values,
        "include": values,
    },
}
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
}
BASES = {
    "chat": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "completions": {"prompt": "The capital of France is", "max_tokens": 2},
    "responses": {"input": "Hi", "max_output_tokens": 2},
}
MISSING = object()  # a field the mutation removes


@st.composite
def bodies(draw, route: str) -> dict:
    """The route's valid base body (greedy, 2 tokens) with one to three fields made wrong."""
    body = {"model": "agentx", "temperature": 0, **BASES[route]}
    fields = FIELDS[route]
    names = draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True))
    for name in names:
        value = draw(st.one_of(fields[name], st.just(MISSING)))
        if value is MISSING:
            body.pop(name, None)
        else:
            body[name] = value
    if draw(st.booleans()):
        body[draw(odd_text)] = draw(values)  # an unknown field: ignored
    return body


def encode(body: object) -> bytes:
    """JSON as a client could send it: NaN and Infinity as Python writes them, lone
    surrogates escaped, :class:`Deep` values written out."""
    deeps: list[Deep] = []

    def mark(value):
        deeps.append(value)
        return f"@deep{len(deeps) - 1}@"

    text = json.dumps(body, default=mark)
    for i, value in enumerate(deeps):
        text = text.replace(f'"@deep{i}@"', value.to_json(), 1)
    return text.encode()


# ---- the app and the property ----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(make_engine_module):
    engine = make_engine_module()
    service = ChatService(engine, default_max_tokens=4)
    yield engine, service, create_app(service)
    service.conversations.clear()
    assert wait_idle(engine).kv_num_held == 0
    engine.check_integrity()


def post(app, path: str, content: bytes, headers=JSON) -> tuple[int, str, bytes]:
    """Status, content type and the whole body (a stream read to its end)."""

    async def main():
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            with anyio.fail_after(HANG_S):
                async with client.stream("POST", path, content=content, headers=headers) as r:
                    return r.status_code, r.headers.get("content-type", ""), await r.aread()

    return anyio.run(main)


def assert_well_formed(route: str, status: int, content_type: str, data: bytes) -> None:
    assert status < 500, data[:500]
    if status >= 400:
        assert content_type.startswith("application/json"), (status, data[:200])
        error = json.loads(data)["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str)
        assert set(error) == {"message", "type", "param", "code"}
        return
    assert status == 200
    if content_type.startswith("text/event-stream"):
        assert_events(route, data)
        return
    body = json.loads(data)
    expected = {"chat": "chat.completion", "completions": "text_completion"}.get(route, "response")
    assert body["object"] == expected
    assert body["output" if route == "responses" else "choices"]


def assert_events(route: str, data: bytes) -> None:
    events = [e for e in data.decode().split("\n\n") if e]
    assert events
    payloads = [line[6:] for e in events for line in e.split("\n") if line.startswith("data: ")]
    if route != "responses":
        assert payloads[-1] == "[DONE]"
        payloads = payloads[:-1]
    for payload in payloads:
        event = json.loads(payload)
        assert "error" not in event, event  # a refusal answers before the stream starts
    if route == "responses":
        assert json.loads(payloads[-1])["type"] in ("response.completed", "response.incomplete")


def assert_clean(engine, service) -> None:
    stats = wait_idle(engine)
    assert stats.kv_num_held == len(service.conversations.get_handles())
    service.conversations.clear()
    assert wait_idle(engine).kv_num_held == 0  # the releases applied (has_pending_controls)
    engine.check_integrity()


def check(served, route: str, body: object) -> None:
    engine, service, app = served
    status, content_type, data = post(app, PATHS[route], encode(body))
    event(f"status {status}")  # --hypothesis-show-statistics: how many were served
    assert_well_formed(route, status, content_type, data)
    assert_clean(engine, service)


@settings(SWEEP, max_examples=EXAMPLES["chat"])
@given(body=bodies("chat"))
def test_chat_completions_bodies(served, body):
    check(served, "chat", body)


@settings(SWEEP, max_examples=EXAMPLES["completions"])
@given(body=bodies("completions"))
def test_completions_bodies(served, body):
    check(served, "completions", body)


@settings(SWEEP, max_examples=EXAMPLES["responses"])
@given(body=bodies("responses"))
def test_responses_bodies(served, body):
    check(served, "responses", body)


@settings(SWEEP, max_examples=EXAMPLES["raw"])
@given(route=st.sampled_from(sorted(PATHS)), body=st.one_of(values, st.binary(max_size=40)))
def test_bodies_that_are_no_request(served, route, body):
    engine, service, app = served
    content = body if isinstance(body, bytes) else encode(body)
    status, content_type, data = post(app, PATHS[route], content)
    assert_well_formed(route, status, content_type, data)
    assert_clean(engine, service)


def test_wrong_content_type_and_methods_answer_json_errors(served):
    engine, service, app = served
    body = encode({"model": "agentx", **BASES["chat"]})
    status, kind, data = post(app, PATHS["chat"], body, {"content-type": "text/plain"})
    assert status == 415 and json.loads(data)["error"]["code"] == "unsupported_media_type"
    status, kind, data = post(app, "/v1/nowhere", body)
    assert status == 404 and kind.startswith("application/json")
    assert_clean(engine, service)


def test_reference_bodies_answer_200(served):
    """The bases the sweep mutates are valid requests: the sweep does explore refusals."""
    engine, service, app = served
    for route, path in PATHS.items():
        body = {"model": "agentx", "temperature": 0, **BASES[route]}
        status, kind, data = post(app, path, encode(body))
        assert status == 200, data
        assert_well_formed(route, status, kind, data)
        streamed = post(app, path, encode({**body, "stream": True}))
        assert streamed[0] == 200 and streamed[1].startswith("text/event-stream")
        assert_well_formed(route, *streamed)
    assert_clean(engine, service)


# ---- what the sweep found (each failed with a 500 before its fix) ----------------------------

FOUND = [
    (  # AttributeError in the constraint builder
        "chat",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "response_format": {"type": "json_schema", "json_schema": [1]},
        },
        "response_format.json_schema must be an object",
    ),
    (  # OverflowError decoding a negative id for echo
        "completions",
        {"prompt": [-1]},
        "token ids outside the vocabulary",
    ),
]


@pytest.mark.parametrize(("route", "body", "message"), FOUND)
def test_sweep_findings_answer_400(served, route, body, message):
    engine, service, app = served
    status, kind, data = post(app, PATHS[route], encode({"model": "agentx", **body}))
    assert status == 400 and message in json.loads(data)["error"]["message"]
    assert_clean(engine, service)
