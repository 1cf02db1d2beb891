"""ToolCallDeltas: streamed tool calls as a header delta and argument fragments, however the
output text is split."""

import json

import pytest

from agentx.openai.tool_deltas import ToolCallDeltas

TWO_CALLS = (
    'Sure. <tool_call>[{"name": "add", "arguments": {"a": 17, "s": "}]</tool_call> {x"}}, '
    '{"name": "b\\u00e9", "arguments": {}}]</tool_call> done'
)


def run(text, step):
    scan, deltas = ToolCallDeltas(), []
    for i in range(0, len(text), step):
        deltas += scan.push(text[i : i + step])
    return scan, deltas


@pytest.mark.parametrize("step", [1, 2, 3, 7, 15, 63, 300])
def test_two_calls_any_split(step):
    scan, deltas = run(TWO_CALLS, step)
    heads = [(d.index, d.name) for d in deltas if d.id is not None]
    assert heads == [(0, "add"), (1, "bé")]
    assert all(d.arguments == "" for d in deltas if d.id is not None)
    arguments = {}
    for d in deltas:
        arguments[d.index] = arguments.get(d.index, "") + d.arguments
    assert json.loads(arguments[0]) == {"a": 17, "s": "}]</tool_call> {x"}
    assert arguments[1] == "{}"
    assert scan.is_streamed(0) and scan.is_streamed(1) and not scan.is_started(2)


def test_text_without_calls_and_other_shapes_give_nothing():
    assert run("just text, no calls at all", 4)[1] == []
    scan, deltas = run('<tool_call>[{"arguments": {"a": 1}, "name": "add"}]</tool_call>', 5)
    assert deltas == [] and not scan.is_started(0)  # keys in another order: sent whole later


def test_a_scalar_argument_value_is_left_to_the_parsed_call():
    scan, deltas = run('<tool_call>[{"name": "f", "arguments": 3}]</tool_call>', 1)
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "f", "")]
    assert scan.is_started(0) and not scan.is_streamed(0)


def test_unfinished_arguments_are_not_streamed_whole():
    scan, deltas = run('<tool_call>[{"name": "f", "arguments": {"a": [1, 2', 3)
    assert "".join(d.arguments for d in deltas) == '{"a": [1, 2'
    assert not scan.is_streamed(0)
