"""tool_choice and response_format: the grammars built for them (text, errors, what they accept
under the default model's tokenizer), and sessions whose constrained replies always parse,
validate and come back ``parsed`` on the real model (``slow``)."""

from __future__ import annotations

import json

import pytest

from agentx import InvalidRequestError, SamplingParams, Session
from agentx.engine.models.loader import default_model_path
from agentx.engine.models.tokenizer import Tokenizer
from agentx.engine.structured import GrammarBackend, StructuredOutput
from agentx.session.constraints import (
    make_turn_constraint,
    response_format_grammar,
    tool_call_grammar,
)
from agentx.session.tools import Tool, make_tools
from tests.helpers.tools import TOOL_PROMPTS, City, add, ship, tag

slow = pytest.mark.slow


TOOLS = list(make_tools([ship, tag, add]).values())


def call_block(*calls: tuple[str, dict]) -> str:
    """A block exactly as the model writes it (and as the grammar forces it)."""
    entries = [{"name": name, "arguments": arguments} for name, arguments in calls]
    return f"<tool_call>{json.dumps(entries)}</tool_call>"


PARIS = {"city": "Paris", "zip_code": "75001"}
SHIP = ("ship", {"address": PARIS, "priority": "high", "weight_kg": 2.5})
ADD = ("add", {"a": 17, "b": 25})


# ---- grammar text and errors (no model) -------------------------------------------------------


def test_required_grammar_is_a_union_of_per_tool_rules():
    grammar = tool_call_grammar(TOOLS, "required").grammar
    lines = grammar.splitlines()
    assert lines[0] == 'start: "<tool_call>" "[" call ("," " "? call)* "]" "</tool_call>"'
    assert lines[1] == "call: call_0 | call_1 | call_2"
    assert lines[2] == 'call_0: "{\\"name\\": \\"ship\\", \\"arguments\\": " args_0 "}"'
    schema = json.loads(lines[3].removeprefix("args_0: %json "))
    # objects are closed (the nested model too), $defs stay with the schema that uses them
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["Address"]["additionalProperties"] is False
    assert schema["properties"]["priority"]["enum"] == ["low", "normal", "high"]
    assert schema["x-guidance"]["item_separator"] == ", "
    assert "TEXT" not in grammar


def test_named_choice_shapes_build_one_tool_grammar():
    named = tool_call_grammar(TOOLS, {"name": "add"})
    assert tool_call_grammar(TOOLS, {"type": "function", "function": {"name": "add"}}) == named
    assert tool_call_grammar(TOOLS, {"type": "tool", "name": "add"}) == named  # Anthropic's
    assert "call: call_0\n" in named.grammar and '\\"add\\"' in named.grammar
    assert "ship" not in named.grammar
    assert tool_call_grammar(TOOLS, {"type": "any"}) == tool_call_grammar(TOOLS, "required")


def test_auto_none_and_no_choice():
    assert tool_call_grammar(TOOLS, None) is None
    auto = tool_call_grammar(TOOLS, "auto").grammar
    assert auto.startswith("start: TEXT | block\n") and "TEXT: " in auto
    none = tool_call_grammar(TOOLS, "none")
    assert none.grammar.startswith("start: TEXT\n") and "%json" not in none.grammar
    assert tool_call_grammar([], "auto") == none  # nothing to call
    assert tool_call_grammar([], "none") == none


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        (TOOLS, {"name": "divide"}, "'divide', which is not a declared tool"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not a declared tool"),
        ([], "required", "needs tools"),
        ([], {"name": "add"}, "needs tools"),
        (TOOLS, "always", "tool_choice must be"),
        (TOOLS, {"type": "function"}, "tool_choice must be"),
        (TOOLS, 3, "tool_choice must be"),
    ],
)
def test_bad_tool_choice_raises(tools, choice, message):
    with pytest.raises(InvalidRequestError, match=message):
        tool_call_grammar(tools, choice)


def test_closing_objects_keeps_data_and_explicit_choices():
    parameters = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "extra": {"type": "object", "additionalProperties": {"type": "string"}},
            "free": {"type": "object"},
            "value": {"const": {"properties": {}}},
        },
    }
    tool = Tool.from_schema("t", "", parameters)
    schema = json.loads(tool_call_grammar([tool], "required").grammar.split("%json ")[1])
    props = schema["properties"]
    assert schema["additionalProperties"] is False
    assert props["properties"]["additionalProperties"] is False
    assert props["extra"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in props["free"]  # no properties listed: any object
    assert props["value"] == {"const": {"properties": {}}}
    assert "additionalProperties" not in tool.parameters  # the tool's own schema is untouched


def test_response_format_shapes():
    structured, validate = response_format_grammar(City)
    assert structured.json_schema["additionalProperties"] is False
    assert validate('{"name": "Paris", "country": "France", "is_capital": true}') == City(
        name="Paris", country="France", is_capital=True
    )
    schema = City.model_json_schema()
    openai = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    assert response_format_grammar(openai)[0] == response_format_grammar(schema)[0]
    assert response_format_grammar(schema)[1] is json.loads
    structured, _ = response_format_grammar({"type": "json_object"})
    assert structured.json_schema["type"] == "object"
    for bad in ("json", City(name="a", country="b", is_capital=False)):
        with pytest.raises(InvalidRequestError, match="response_format must be"):
            response_format_grammar(bad)
    with pytest.raises(InvalidRequestError, match="json_schema"):
        response_format_grammar({"type": "json_schema", "json_schema": {}})


def test_misuse_raises_before_the_turn_opens():
    with pytest.raises(InvalidRequestError, match="cannot be combined"):
        make_turn_constraint(TOOLS, "required", City)
    s = Session(tools=[add])  # no engine is touched: these fail while building the turn
    with pytest.raises(InvalidRequestError, match="prefill"):
        s.stream("x", tool_choice="required", prefill="<tool_call>[")
    with pytest.raises(InvalidRequestError, match="prefill"):
        s.stream("x", response_format=City, prefill="{")
    with pytest.raises(InvalidRequestError, match="cannot be combined"):
        s.stream("x", tool_choice="auto", response_format=City)
    with pytest.raises(InvalidRequestError, match="not a declared tool"):
        s.stream("x", tool_choice={"name": "ship"})
    preset = SamplingParams(structured=StructuredOutput(regex="[0-9]+"))
    with pytest.raises(InvalidRequestError, match="already set"):
        s.stream("x", sampling=preset, tool_choice="required")
    assert s._engine is None and s._turn is None


# ---- what the grammars accept (the default model's tokenizer, no weights) ---------------------


@pytest.fixture(scope="module")
def accepts():
    tokenizer = Tokenizer.from_gguf(default_model_path())
    backend = GrammarBackend(
        tokenizer.backend.to_str(), tokenizer.vocab_size, frozenset(tokenizer.eos_token_ids)
    )

    def check(spec: StructuredOutput, text: str) -> bool:
        matcher = backend.new_matcher(spec)
        return all(matcher.accept(t) for t in tokenizer.encode(text)) and matcher.is_accepting

    return check


def test_required_accepts_exactly_valid_calls(accepts):
    required = tool_call_grammar(TOOLS, "required")
    assert accepts(required, call_block(SHIP))
    assert accepts(required, call_block(ADD, SHIP, ("tag", {"labels": ["a", "b"], "count": 2})))
    rejected = [
        "The answer is 42.",
        call_block(),  # no call
        call_block(("add", {"a": 17})),  # a required argument missing
        call_block(("add", {"a": 17, "b": 25, "c": 1})),  # an argument the tool does not take
        call_block(("add", {"a": 17.5, "b": 25})),  # a float for an int
        call_block(("divide", {"a": 1, "b": 2})),  # no such tool
        call_block(("ship", {**SHIP[1], "priority": "urgent"})),  # not in the Literal
        call_block(("ship", {**SHIP[1], "address": {"city": "Paris", "zip_code": "7500"}})),
        call_block(("tag", {"labels": [], "count": 0})),  # min_length
        call_block(("tag", {"labels": ["x" * 17], "count": 1})),  # max_length of an item
        call_block(ADD) + " and more",
        '<tool_call>[{"name":"add","arguments":{"a":17,"b":25}}]</tool_call>',  # not its spacing
    ]
    assert [text for text in rejected if accepts(required, text)] == []


def test_named_accepts_only_that_tool(accepts):
    named = tool_call_grammar(TOOLS, {"name": "add"})
    assert accepts(named, call_block(ADD, ("add", {"a": 1, "b": 2})))
    assert not accepts(named, call_block(SHIP))
    assert not accepts(named, call_block(ADD, SHIP))


def test_auto_and_none_accept_text_or_calls(accepts):
    auto = tool_call_grammar(TOOLS, "auto")
    none = tool_call_grammar(TOOLS, "none")
    for text in ("", "The answer is 42.", "a < b\nuse <b>bold</b>"):
        assert accepts(auto, text) and accepts(none, text)
    assert accepts(auto, call_block(ADD)) and not accepts(none, call_block(ADD))
    assert accepts(auto, call_block())  # "make the list empty", as the tools prompt says
    for text in ("Sure: " + call_block(ADD), "<b>bold</b>", call_block(("add", {"a": 1}))):
        assert not accepts(auto, text)
    assert not accepts(none, "Sure: " + call_block(ADD))


def test_response_format_accepts_only_the_schema(accepts):
    structured, _ = response_format_grammar(City)
    assert accepts(structured, '{"name": "Paris", "country": "France", "is_capital": true}')
    assert not accepts(structured, '{"name": "Paris", "country": "France"}')
    assert not accepts(structured, '{"name": "Paris", "country": "France", "is_capital": 1}')
    extra = '{"name": "Paris", "country": "France", "is_capital": true, "x": 1}'
    assert not accepts(structured, extra)


# ---- sessions on the real model ---------------------------------------------------------------


@slow
async def test_required_calls_always_parse_and_validate(default_engine):
    """Temperature 1.0 over three tool shapes: every call validates. A turn that would run past
    max_tokens (many calls in a row) is closed by the budget: "length", its calls still valid."""
    num_stopped = 0
    async with Session(default_engine, tools=[ship, tag, add]) as base:
        for seed in range(9):
            s = await base.fork()
            sampling = SamplingParams(temperature=1.0, seed=seed, max_tokens=96)
            reply = await s.send(TOOL_PROMPTS[seed % 3], tool_choice="required", sampling=sampling)
            assert reply.content == "" and reply.tool_calls
            if reply.finish_reason == "length":
                assert reply.usage.output_tokens <= 96
            else:
                assert reply.finish_reason == "stop"
                num_stopped += 1
            for call in reply.tool_calls:
                assert call.ok, call.error
                await s.tools[call.name].invoke(call.arguments)  # raises if invalid
            await s.close()
    assert num_stopped >= 6


async def test_one_call_without_parallel_tool_calls(default_engine):
    """The grammar of a turn with ``parallel_tool_calls=False`` holds one call: the reply's
    block closes after it, where the parallel grammar lets the model go on ("length")."""
    sampling = SamplingParams(max_tokens=96)
    async with Session(default_engine, tools=[ship, tag, add], sampling=sampling) as s:
        turn = s.stream(TOOL_PROMPTS[2], tool_choice="required", parallel_tool_calls=False)
        grammar = turn._sampling.structured.grammar
        assert grammar.splitlines()[0] == 'start: "<tool_call>" "[" call "]" "</tool_call>"'
        async with turn:
            reply = await turn.get_final_message()
        assert len(reply.tool_calls) == 1 and reply.tool_calls[0].ok
        assert reply.finish_reason == "stop" and reply.content == ""
        assert reply.usage.output_tokens < 96


@slow
async def test_named_tool_choice_and_run_loop(default_engine):
    sampling = SamplingParams(max_tokens=48)
    async with Session(default_engine, tools=[ship, tag, add], sampling=sampling) as s:
        reply = await s.send(TOOL_PROMPTS[2], tool_choice={"name": "tag"})
        assert [c.name for c in reply.tool_calls] and {c.name for c in reply.tool_calls} == {"tag"}
        assert all(c.ok for c in reply.tool_calls) and reply.finish_reason == "stop"
        child = await s.fork()  # the grammar ended with its turn
        assert child.sampling.structured is None
        await child.close()
    async with Session(default_engine, tools=[ship, tag, add], sampling=sampling) as s:
        openai = {"type": "function", "function": {"name": "add"}}
        reply = await s.run(TOOL_PROMPTS[2], tool_choice=openai, max_turns=2)
        (call,) = s.messages[1].tool_calls
        assert call.name == "add" and s.messages[2].content == str(add(**call.arguments))
        assert reply is s.messages[-1] and reply.finish_reason in ("stop", "length")


@slow
async def test_response_format_returns_parsed(default_engine):
    async with Session(default_engine, sampling=SamplingParams(max_tokens=64)) as s:
        reply = await s.send("Describe Paris as JSON.", response_format=City)
        assert reply.finish_reason == "stop" and reply.parse_error is None
        assert isinstance(reply.parsed, City)
        assert reply.parsed == City.model_validate_json(reply.content)
        reply = await s.send("And Rome?", response_format=City.model_json_schema())
        assert reply.parsed == json.loads(reply.content) and set(reply.parsed) == set(
            City.model_fields
        )
        with pytest.raises(InvalidRequestError, match="shortest output"):
            await s.send("And Oslo?", response_format=City, sampling=SamplingParams(max_tokens=3))
        spec = response_format_grammar(City)[0]
        minimum = default_engine.core._grammar_backend().min_tokens(spec)
        tight = SamplingParams(max_tokens=minimum)  # every token forced: the budget closes it
        cut = await s.send("And Oslo?", response_format=City, sampling=tight)
        assert cut.finish_reason == "length" and cut.parse_error is None
        assert cut.parsed == City.model_validate_json(cut.content)
        after = await s.send("Thanks.")  # unconstrained again; the history stayed consistent
        assert after.parsed is None and after.finish_reason in ("stop", "length")


@slow
async def test_auto_and_none_never_produce_malformed_calls(default_engine):
    async with Session(default_engine, tools=[ship, tag, add]) as base:
        for seed, choice in [(0, "auto"), (1, "auto"), (0, "none")]:
            s = await base.fork()
            sampling = SamplingParams(temperature=1.0, seed=seed, max_tokens=64)
            reply = await s.send(TOOL_PROMPTS[seed], tool_choice=choice, sampling=sampling)
            if choice == "none":
                assert reply.tool_calls == [] and not reply.content.startswith("<")
            elif reply.finish_reason == "stop":
                for call in reply.tool_calls:
                    assert call.ok, call.error
                    await s.tools[call.name].invoke(call.arguments)
            await s.close()
