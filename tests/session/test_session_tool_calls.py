"""SmolLM2 tool-call markup: the system prompt, parsing (whole and streamed), re-rendering."""

import itertools
import json

import pytest

from agentx.session.messages import ToolCall
from agentx.session.tool_calls import (
    ToolCallParser,
    ToolCallStreamFilter,
    render_tool_calls,
    render_tools_system_prompt,
)

UNTERMINATED = "unterminated <tool_call> block: the output ended before </tool_call>"


def counting_parser() -> ToolCallParser:
    counter = itertools.count()
    return ToolCallParser(id_factory=lambda: f"call_{next(counter)}")


def call(id: str, name: str, **arguments) -> ToolCall:
    return ToolCall(id=id, name=name, arguments=arguments)


def bad(id: str, name: str, raw: str, error: str) -> ToolCall:
    return ToolCall(id=id, name=name, arguments={}, raw=raw, error=error)


BLOCK_LIST = (
    '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
    '{"name": "now", "arguments": {}}]</tool_call>'
)
BAD_JSON = '<tool_call>[{"name": "add", "arguments": {"a": 1]</tool_call>'
BAD_JSON_ERROR = "invalid JSON: Expecting ',' delimiter: line 1 column 38 (char 37)"
UNCLOSED = '<tool_call>[{"name": "add", "arguments": {"a": "x]</tool_call>'
UNCLOSED_ERROR = "invalid JSON: Unterminated string starting at: line 1 column 37 (char 36)"
NO_NAME = '<tool_call>[{"arguments": {"a": 1}}]</tool_call>'
LIST_ARGS = '<tool_call>[{"name": "add", "arguments": [1, 2]}]</tool_call>'

CASES = [
    # (model output, remaining text, calls)
    (BLOCK_LIST, "", [call("call_0", "add", a=1, b=2), call("call_1", "now")]),
    (
        '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>',
        "",
        [call("call_0", "weather", city="Paris")],
    ),
    (
        'Let me check.\n<tool_call>[{"name": "now", "arguments": {}}]</tool_call>\nDone.',
        "Let me check.\n\nDone.",
        [call("call_0", "now")],
    ),
    (
        '<tool_call>[{"name": "add", "arguments": {"a": 1}}]</tool_call> and '
        '<tool_call>\n  [\n {"name": "now"}\n ]\n</tool_call>',
        " and ",
        [call("call_0", "add", a=1), call("call_1", "now")],
    ),
    (
        '<tool_call>[{"name": "add", "arguments": "{\\"a\\": 5}"}]</tool_call>',
        "",
        [call("call_0", "add", a=5)],
    ),
    (
        "<tool_call>[{'name': 'flag', 'arguments': {'on': True, 'tag': None}}]</tool_call>",
        "",
        [call("call_0", "flag", on=True, tag=None)],
    ),
    ("<tool_call>[]</tool_call>", "", []),
    (  # the closing tag inside a string is text (a grammar allows it there)
        '<tool_call>[{"name": "edit", "arguments": {"new": "</tool_call> \\"q\\""}}]</tool_call>!',
        "!",
        [call("call_0", "edit", new='</tool_call> "q"')],
    ),
    (  # a string never closed: the first closing tag ends the block, as it always did
        UNCLOSED + ' then <tool_call>[{"name": "now"}]</tool_call>',
        " then ",
        [bad("call_0", "add", UNCLOSED, UNCLOSED_ERROR), call("call_1", "now")],
    ),
    (
        "no calls here, only <b>html</b> and a < sign",
        "no calls here, only <b>html</b> and a < sign",
        [],
    ),
    ("ends with a partial tag <tool_c", "ends with a partial tag <tool_c", []),
    ("a stray </tool_call> closer", "a stray </tool_call> closer", []),
    (
        BAD_JSON,
        "",
        [bad("call_0", "add", BAD_JSON, BAD_JSON_ERROR)],
    ),
    (NO_NAME, "", [bad("call_0", "", NO_NAME, 'tool call 0 has no "name" string')]),
    (
        LIST_ARGS,
        "",
        [bad("call_0", "add", LIST_ARGS, "arguments of 'add' must be an object, got list")],
    ),
    (
        '<tool_call>[{"name": "add", "arguments": "not json"}]</tool_call>',
        "",
        [
            bad(
                "call_0",
                "add",
                '<tool_call>[{"name": "add", "arguments": "not json"}]</tool_call>',
                "arguments of 'add' are a string that is not JSON",
            )
        ],
    ),
    (
        "<tool_call>[1]</tool_call>",
        "",
        [bad("call_0", "", "<tool_call>[1]</tool_call>", "tool call 0 is not an object")],
    ),
    (
        "<tool_call>{'a': {1, 2}}</tool_call>",  # a Python set: a literal, but not JSON
        "",
        [
            bad(
                "call_0",
                "",
                "<tool_call>{'a': {1, 2}}</tool_call>",
                "invalid JSON: Expecting property name enclosed in double quotes: "
                "line 1 column 2 (char 1)",
            )
        ],
    ),
    (
        "<tool_call>  \n</tool_call>",
        "",
        [bad("call_0", "", "<tool_call>  \n</tool_call>", "empty <tool_call> block")],
    ),
    (
        'Sure. <tool_call>[{"name": "add", "arguments": {"a": 1',
        "Sure. ",
        [bad("call_0", "add", '<tool_call>[{"name": "add", "arguments": {"a": 1', UNTERMINATED)],
    ),
    (
        '<tool_call>[{"name": "now"}]</tool_call>' + BAD_JSON + "tail",
        "tail",
        [
            call("call_0", "now"),
            bad("call_1", "add", BAD_JSON, BAD_JSON_ERROR),
        ],
    ),
]


@pytest.mark.parametrize(("text", "remaining", "calls"), CASES)
def test_parse(text, remaining, calls):
    assert counting_parser().parse(text) == (remaining, calls)


@pytest.mark.parametrize(("text", "remaining", "calls"), CASES)
def test_stream_char_by_char_equals_parse(text, remaining, calls):
    stream = ToolCallStreamFilter(counting_parser())
    shown = [stream.push(ch) for ch in text]
    tail, streamed_calls = stream.finish()
    assert "".join(shown) + tail == remaining
    assert streamed_calls == calls
    assert not any("<tool_call>" in piece for piece in shown)


@pytest.mark.parametrize("size", [2, 3, 5, 11, 64])
def test_stream_any_chunking_equals_parse(size):
    text = "".join(text for text, _, _ in CASES)
    expected = counting_parser().parse(text)
    stream = ToolCallStreamFilter(counting_parser())
    shown = "".join(stream.push(text[i : i + size]) for i in range(0, len(text), size))
    tail, calls = stream.finish()
    assert (shown + tail, calls) == expected


def test_stream_holds_back_only_a_possible_tag_and_releases_calls_on_close():
    stream = ToolCallStreamFilter(counting_parser())
    assert stream.push("Hello <") == "Hello "
    assert stream.push("b>") == "<b>"
    assert stream.push(" <tool_") == " "
    assert stream.push('call>[{"name": "now"}]') == ""
    assert stream.take_calls() == []
    assert stream.push("</tool_call> bye") == " bye"
    assert stream.take_calls() == [call("call_0", "now")]
    assert stream.take_calls() == []
    assert stream.finish() == ("", [call("call_0", "now")])
    with pytest.raises(RuntimeError, match="after finish"):
        stream.push("x")


def test_unterminated_block_is_taken_after_finish():
    stream = ToolCallStreamFilter(counting_parser())
    assert stream.push("<tool_call>[") == ""
    tail, calls = stream.finish()
    assert (tail, calls) == ("", [bad("call_0", "", "<tool_call>[", UNTERMINATED)])
    assert stream.take_calls() == calls


def test_default_ids_are_unique():
    calls = ToolCallParser().parse(BLOCK_LIST + BLOCK_LIST)[1]
    ids = [c.id for c in calls]
    assert len(set(ids)) == 4
    assert all(i.startswith("call_") and len(i) == len("call_") + 12 for i in ids)


def test_render_tool_calls_exact_text():
    calls = [call("x", "add", a=1, b="é"), call("y", "now")]
    assert render_tool_calls(calls) == (
        '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": "é"}}, '
        '{"name": "now", "arguments": {}}]</tool_call>'
    )
    assert render_tool_calls([]) == ""


def test_render_parse_round_trip():
    calls = [
        call("a", "add", a=1, b=[1, 2], c={"d": None}),
        call("b", "now"),
        bad("c", "add", BAD_JSON, BAD_JSON_ERROR),
        call("d", "weather", city="Zürich"),
    ]
    text = render_tool_calls(calls)
    remaining, parsed = counting_parser().parse(text)
    assert remaining == ""
    assert [c.model_copy(update={"id": ""}) for c in parsed] == [
        c.model_copy(update={"id": ""}) for c in calls
    ]


def test_system_prompt_lists_tools_and_format_then_base():
    tools = [{"name": "add", "description": "Add.", "parameters": {"type": "object"}}]
    prompt = render_tools_system_prompt(tools, base="Be brief.")
    assert prompt.startswith("You are an expert in composing functions.")
    listing = f"You have access to the following tools:\n<tools>{json.dumps(tools)}</tools>\n\n"
    assert listing in prompt
    assert prompt.index(listing) < prompt.index("The output MUST strictly adhere")
    assert prompt.endswith(
        '<tool_call>[{"name": "func_name1", "arguments": '
        '{"argument1": "value1", "argument2": "value2"}}]</tool_call>\n\nBe brief.'
    )
    assert render_tools_system_prompt(tools) == prompt.removesuffix("\n\nBe brief.")
