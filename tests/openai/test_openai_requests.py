"""agentx.openai without a model: request parsing, match keys, the held-conversation LRU, and
streamed text split into content and tool calls."""

import json

import anyio
import pytest

from agentx.engine.sampling import MAX_SEED, SamplingParams
from agentx.errors import (
    EngineClosedError,
    InvalidRequestError,
    PromptTooLongError,
    RequestAbortedError,
    RequestFailedError,
)
from agentx.openai.api import APIHandler
from agentx.openai.conversations import ConversationCache, HeldConversation
from agentx.openai.errors import to_api_error
from agentx.openai.requests import assistant_key, parse_chat_request
from agentx.openai.responses import ChoiceText
from agentx.openai.service import ChatService, cache_salt, choice_sampling
from agentx.session.messages import ToolCall
from agentx.session.tool_calls import ToolCallParser

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def body(**fields):
    return {"model": "agentx", "messages": [{"role": "user", "content": "Hi"}], **fields}


def test_defaults_follow_openai():
    request = parse_chat_request(body())
    assert request.sampling.temperature == 1.0 and request.sampling.top_p == 1.0
    assert request.max_tokens is None and request.n == 1 and not request.stream
    assert request.system is None and request.messages == ({"role": "user", "content": "Hi"},)
    assert request.keys == (("user", "Hi", ()),)


def test_sampling_fields():
    request = parse_chat_request(
        body(
            temperature=0,
            top_p=0.5,
            seed=7,
            stop=".",
            max_tokens=9,
            max_completion_tokens=5,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert request.sampling.temperature == 0.0 and request.sampling.top_p == 0.5
    assert request.sampling.seed == 7 and request.sampling.stop == (".",)
    assert request.max_tokens == 5  # max_completion_tokens wins
    assert (request.n, request.stream, request.include_usage) == (3, True, True)


def test_leading_system_or_developer_message_is_the_setup():
    for role in ("system", "developer"):
        request = parse_chat_request(
            {"messages": [{"role": role, "content": "Be brief."}, {"role": "user", "content": "x"}]}
        )
        assert request.system == "Be brief."
        assert request.messages == ({"role": "user", "content": "x"},)
    later = parse_chat_request(
        {"messages": [{"role": "user", "content": "x"}, {"role": "developer", "content": "y"}]}
    )
    assert later.system is None and later.messages[1] == {"role": "system", "content": "y"}


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    request = parse_chat_request({"messages": [{"role": "user", "content": parts}]})
    assert request.messages[0]["content"] == "Hello, world"


def test_assistant_history_renders_calls_in_the_models_markup():
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    call["function"]["arguments"] = json.dumps({"b": 2, "a": 1})
    request = parse_chat_request(
        {
            "messages": [
                {"role": "user", "content": "Add."},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"},
            ]
        }
    )
    assert request.messages[1] == {
        "role": "assistant",
        "content": '<tool_call>[{"name": "add", "arguments": {"b": 2, "a": 1}}]</tool_call>',
    }
    assert request.messages[2] == {"role": "tool", "content": "3"}
    # the key is what the template shows: no ids, arguments canonical
    returned = ToolCall(id="call_other", name="add", arguments={"a": 1, "b": 2})
    assert request.keys[1] == assistant_key(None, [returned])


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role must be"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text content"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"logprobs": "yes"}, "logprobs must be a boolean"),
        ({"top_logprobs": 3}, "top_logprobs needs logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"n": 0}, "n must be between 1 and 16"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop must be"),
        ({"tools": [{"type": "web_search"}]}, "only function tools"),
        ({"tools": [ADD, ADD]}, "duplicate tool names"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"model": "agentx\ud800"}, "lone surrogate"),  # was: a plain-text 500 at encode
    ],
)
def test_refusals_name_the_field(fields, words):
    with pytest.raises(InvalidRequestError, match=words):
        parse_chat_request({**body(), **fields})


def test_a_body_nested_too_deeply_is_a_400_not_a_crash():
    content = b'{"model": "agentx", "messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    handler = APIHandler(ChatService())
    answer = anyio.run(handler.handle, "POST", "/v1/chat/completions", content)
    assert answer.status == 400 and answer.body["error"]["type"] == "invalid_request_error"
    assert "nested too deeply" in answer.body["error"]["message"]


def test_refused_fields_at_their_defaults_are_accepted():
    request = parse_chat_request(body(logprobs=False, presence_penalty=0, user="u", store=False))
    assert request.n == 1


def test_setup_key_changes_with_system_and_tools():
    plain = parse_chat_request(body())
    tools = parse_chat_request(body(tools=[ADD]))
    system = parse_chat_request(
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]}
    )
    assert len({plain.setup_key, tools.setup_key, system.setup_key}) == 3
    assert parse_chat_request(body(tools=[ADD], tool_choice="required")).setup_key == (
        tools.setup_key
    )  # a grammar does not change the prompt


def test_errors_map_to_openai_statuses():
    assert to_api_error(InvalidRequestError("bad")).status == 400
    too_long = to_api_error(PromptTooLongError("long"))
    assert too_long.status == 400 and too_long.body["error"]["code"] == "context_length_exceeded"
    assert to_api_error(RequestAbortedError()).status == 499
    assert to_api_error(EngineClosedError("closed")).status == 503
    assert to_api_error(RecursionError()).status == 400
    failed = to_api_error(RequestFailedError("request r failed while it ran"))
    assert failed.status == 500 and failed.body["error"]["code"] == "request_failed"
    crash = to_api_error(RuntimeError("boom"))
    assert crash.status == 500 and crash.body["error"]["message"] == "RuntimeError: boom"


# ---- the held-conversation LRU ---------------------------------------------------------------


class FakeContext:
    def check_integrity(self):
        pass


def held(keys, handle, setup=("s", "[]")):
    return HeldConversation(setup, tuple(keys), FakeContext(), handle)


def key(i):
    return ("user", f"m{i}", ())


def test_take_returns_the_longest_held_prefix_and_removes_it():
    released = []
    cache = ConversationCache(4, released.append)
    cache.put(held([key(0)], "h0"))
    cache.put(held([key(0), key(1)], "h1"))
    cache.put(held([key(0), key(1)], "h-other-setup", setup=("t", "[]")))
    cache.put(held([key(5)], "h5"))
    found = cache.take(("s", "[]"), (key(0), key(1), key(2)))
    assert found.handle == "h1"
    assert cache.take(("s", "[]"), (key(0), key(1), key(2))).handle == "h0"
    assert cache.take(("s", "[]"), (key(0), key(1))) is None
    assert cache.take(("s", "[]"), (key(5),)).handle == "h5"  # equal keys continue too
    assert released == [] and cache.get_handles() == ["h-other-setup"]
    cache.check_integrity()


def test_eviction_and_clear_release_each_handle_once():
    released = []
    cache = ConversationCache(2, released.append)
    for i in range(4):
        cache.put(held([key(i)], f"h{i}"))
    assert released == ["h0", "h1"] and cache.get_handles() == ["h2", "h3"]
    cache.put(held([key(9)], None))  # a reply the engine kept no KV for
    assert released == ["h0", "h1", "h2"]
    cache.clear()
    assert released == ["h0", "h1", "h2", "h3"] and len(cache) == 0


# ---- streamed text -> content and tool calls -------------------------------------------------


def counting_parser():
    ids = iter(range(100))
    return ToolCallParser(id_factory=lambda: f"call_{next(ids)}")


def test_choice_text_splits_calls_out_of_content_however_streamed():
    text = 'Sure. <tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>'
    for size in (1, 3, len(text)):
        choice = ChoiceText(True, counting_parser())
        shown, calls = [], []
        for start in range(0, len(text), size):
            delta, new = choice.push(text[start : start + size])
            shown.append(delta)
            calls += new
        tail, new = choice.finish()
        shown.append(tail)
        calls += new
        assert "".join(shown) == choice.content == "Sure. "
        assert [(c.id, c.name, c.arguments) for c in calls] == [("call_0", "add", {"a": 1, "b": 2})]


def test_choice_text_keeps_a_malformed_block_as_content():
    choice = ChoiceText(True, counting_parser())
    shown, calls = choice.push("<tool_call>[{not json}]</tool_call>")
    assert calls == [] and shown == "<tool_call>[{not json}]</tool_call>"
    assert choice.calls == []


def test_choice_text_without_calls_shows_everything():
    choice = ChoiceText(False)
    assert choice.push('{"a": "<tool_call>"}') == ('{"a": "<tool_call>"}', [])
    assert choice.finish() == ("", [])


def test_choice_seeds_stay_in_range():
    """``n`` choices offset the seed by their index: the largest seed wraps to 0 (was: choice
    1 of seed 2**63 - 1 asked for seed 2**63, a 400 for a valid request)."""
    top = SamplingParams(seed=MAX_SEED)
    assert choice_sampling(top, 0) is top
    assert [choice_sampling(top, k).seed for k in (1, 2)] == [0, 1]
    assert choice_sampling(SamplingParams(seed=5), 2).seed == 7
    assert choice_sampling(SamplingParams(), 3).seed is None  # unseeded choices stay unseeded


def test_the_tenant_is_the_prompt_cache_key_else_the_user():
    assert parse_chat_request(body(user="u")).tenant == "user:u"
    keyed = parse_chat_request(body(user="u", prompt_cache_key="k"))
    assert keyed.tenant == "prompt_cache_key:k"
    assert (
        parse_chat_request(body()).tenant is None
        and parse_chat_request(body(user="")).tenant is None
    )
    with pytest.raises(InvalidRequestError, match="user must be a string"):
        parse_chat_request(body(user=7))
    # an API key's tenant and the body's name one salt together; no tenant is the shared cache
    assert cache_salt("key:ab", "user:u") == "key:ab\x1fuser:u"
    assert cache_salt("key:ab", "user:u") != cache_salt("key:cd", "user:u")
    assert cache_salt(None, None) is None
