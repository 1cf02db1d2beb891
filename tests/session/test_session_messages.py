"""Messages, tool calls, usage and turn events: shapes, coercion and its errors."""

import dataclasses

import pytest

from agentx.errors import InvalidRequestError
from agentx.session.events import TextDelta, ToolCallEvent, TurnDone, TurnEvent
from agentx.session.messages import (
    AssistantMessage,
    SystemMessage,
    ToolCall,
    ToolMessage,
    Usage,
    UserMessage,
    coerce_message,
    to_template_dict,
)


def test_tool_call_ok_and_malformed():
    good = ToolCall(id="call_1", name="add", arguments={"a": 1})
    bad = ToolCall(id="call_2", name="", arguments={}, raw="<tool_call>[</tool_call>", error="x")
    assert good.ok and good.raw == "" and good.error is None
    assert not bad.ok


def test_tool_call_accepts_openai_shape():
    call = ToolCall.model_validate(
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    )
    assert call == ToolCall(id="c1", name="add", arguments={"a": 1})
    broken = ToolCall.model_validate(
        {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{"}}
    )
    assert (broken.name, broken.arguments, broken.raw) == ("add", {}, "{")
    assert broken.error.startswith("invalid JSON arguments:")


def test_usage_add_sums_counts_and_keeps_left_timings():
    parent = Usage(
        prompt_tokens=10, cached_tokens=4, computed_tokens=6, output_tokens=3, ttft_s=0.5
    )
    child = Usage(
        prompt_tokens=5,
        cached_tokens=1,
        computed_tokens=4,
        output_tokens=2,
        ttft_s=0.1,
        output_tokens_per_s=20.0,
    )
    assert parent + child == Usage(
        prompt_tokens=15,
        cached_tokens=5,
        computed_tokens=10,
        output_tokens=5,
        ttft_s=0.5,
        output_tokens_per_s=20.0,  # the left has none: the right's is kept
    )
    assert Usage() + child == child
    assert sum([parent, child, child]).output_tokens == 7


def test_roles_default_and_text():
    assert SystemMessage(content="s").role == "system"
    assert UserMessage(content="u").role == "user"
    assert ToolMessage(tool_call_id="c1", content="4").role == "tool"
    message = AssistantMessage(content="hello")
    assert (message.role, message.text, message.tool_calls, message.usage) == (
        "assistant",
        "hello",
        [],
        None,
    )


def test_coerce_message_from_str_dict_and_message():
    assert coerce_message("hi") == UserMessage(content="hi")
    system = SystemMessage(content="be brief")
    assert coerce_message(system) is system
    assistant = coerce_message(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "name": "add", "arguments": {"a": 1}}],
        }
    )
    assert assistant == AssistantMessage(
        content="", tool_calls=[ToolCall(id="c1", name="add", arguments={"a": 1})]
    )
    tool = coerce_message({"role": "tool", "tool_call_id": "c1", "content": "2", "is_error": True})
    assert tool == ToolMessage(tool_call_id="c1", content="2", is_error=True)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"content": "x"}, "message role must be one of system, user, assistant, tool; got None"),
        ({"role": "bot", "content": "x"}, "message role must be one of system, user, assistant, "),
        ({"role": "user"}, "invalid user message: content: Field required"),
        (
            {"role": "tool", "content": "x"},
            "invalid tool message: tool_call_id: Field required",
        ),
        (3, "a message must be a str, a dict or a Message, not int"),
    ],
)
def test_coerce_message_errors(item, message):
    with pytest.raises(InvalidRequestError) as info:
        coerce_message(item)
    assert str(info.value).startswith(message)


def test_to_template_dict_is_role_and_content():
    assert to_template_dict(UserMessage(content="hi")) == {"role": "user", "content": "hi"}
    call = ToolCall(id="c1", name="add", arguments={})
    assert to_template_dict(AssistantMessage(content="ok", tool_calls=[call])) == {
        "role": "assistant",
        "content": "ok",
    }
    assert to_template_dict(ToolMessage(tool_call_id="c1", content="4", name="add")) == {
        "role": "tool",
        "content": "4",
    }


def test_events_are_tagged_frozen_records():
    call = ToolCall(id="c1", name="add", arguments={"a": 1})
    message = AssistantMessage(content="hi", tool_calls=[call])
    events = [TextDelta("hi"), ToolCallEvent(call), TurnDone(message, Usage(output_tokens=2))]
    assert [e.type for e in events] == ["text.delta", "tool_call", "turn.done"]
    assert all(isinstance(e, TurnEvent) for e in events)
    assert events[1].call is call
    with pytest.raises(dataclasses.FrozenInstanceError):
        events[0].text = "changed"
    with pytest.raises(TypeError):
        TextDelta(type="tool_call", text="x")  # the tag is fixed by the class


def test_public_names_are_sorted():
    from agentx.session import events, messages, tool_calls, tools

    for module in (events, messages, tool_calls, tools):
        assert module.__all__ == sorted(module.__all__)
        assert all(hasattr(module, name) for name in module.__all__)
