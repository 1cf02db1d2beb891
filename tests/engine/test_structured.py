"""Grammar-constrained sampling in the engine: 200 sampled tool calls over three schemas all
parse and validate; regex and choice hold; unconstrained greedy output is unchanged."""

import json
import re
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

from agentx import InvalidRequestError, SamplingParams
from agentx.engine.structured import StructuredOutput, compact_json
from agentx.session.tool_calls import ToolCallParser

pytestmark = pytest.mark.slow


class Address(BaseModel, extra="forbid"):
    city: str = Field(max_length=24)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class CreateUser(BaseModel, extra="forbid"):
    name: str = Field(max_length=24)
    address: Address


class SetMode(BaseModel, extra="forbid"):
    mode: Literal["fast", "safe", "off"]
    level: int = Field(ge=0, le=10)


class Plot(BaseModel, extra="forbid"):
    title: str = Field(max_length=24)
    # a float with bounded digits: unbounded ones let a sampled model write digits forever
    values: list[Annotated[float, Field(ge=0, le=100, multiple_of=0.01)]] = Field(
        min_length=1, max_length=4
    )
    tags: list[Annotated[str, Field(max_length=16)]] = Field(max_length=3)


TOOLS = {"create_user": CreateUser, "set_mode": SetMode, "plot": Plot}


def call_grammar(name: str, model: type[BaseModel]) -> StructuredOutput:
    arguments = model.model_json_schema()
    defs = arguments.pop("$defs", {})  # "#/$defs/..." refs resolve against the root
    schema = {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "$defs": defs,
    }
    body = json.dumps(compact_json(schema))
    lark = f'start: "<tool_call>[" call "]</tool_call>"\ncall: %json {body}'
    return StructuredOutput(grammar=lark)


def prompt_for(engine, name):
    tok = engine.tokenizer
    ask = f"Call the {name} tool with sensible arguments."
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": ask}]))


def test_200_sampled_tool_calls_parse_and_validate(default_engine):
    parser = ToolCallParser()
    prompts, params, expected = [], [], []
    for i in range(200):
        name = list(TOOLS)[i % 3]
        prompts.append(prompt_for(default_engine, name))
        params.append(
            SamplingParams(
                temperature=1.0, seed=i, max_tokens=160, structured=call_grammar(name, TOOLS[name])
            )
        )
        expected.append(name)
    streams = [default_engine.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
    gens = [s.result(timeout=600) for s in streams]
    for gen, name in zip(gens, expected, strict=True):
        assert gen.finish_reason == "stop" and gen.stop_reason == "grammar", gen.text
        text, calls = parser.parse(gen.text)
        assert text.strip() == "" and len(calls) == 1 and calls[0].ok, gen.text
        assert calls[0].name == name
        TOOLS[name].model_validate(calls[0].arguments)
    # really sampled, not one answer 200 times (set_mode's 67 calls choose from a small enum,
    # so they repeat: 150 distinct texts with the kernels of 2026-12-03)
    assert len({g.text for g in gens}) > 120
    default_engine.check_integrity()


def test_regex_and_choice_hold(default_engine):
    tok = default_engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "A phone number?"}]))
    phone = StructuredOutput(regex=r"[0-9]{3}-[0-9]{4}")
    choice = StructuredOutput(choice=("red", "green", "blue"))
    for seed in range(5):
        sampled = SamplingParams(temperature=1.0, seed=seed, max_tokens=16, structured=phone)
        gen = default_engine.generate([prompt], sampled)[0]
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", gen.text) and gen.stop_reason == "grammar"
        sampled = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, structured=choice)
        assert default_engine.generate([prompt], sampled)[0].text in choice.choice


def test_unconstrained_greedy_is_unchanged_beside_constrained(default_engine, greedy_prompts):
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = [g.token_ids for g in default_engine.generate(greedy_prompts, greedy)]
    constrained = SamplingParams(
        temperature=1.0, seed=3, max_tokens=64, structured=call_grammar("set_mode", SetMode)
    )
    others = [default_engine.add_request(prompt_for(default_engine, "set_mode"), constrained)]
    mixed = [default_engine.add_request(p, greedy) for p in greedy_prompts]
    others += [default_engine.add_request(prompt_for(default_engine, "plot"), constrained)]
    assert [s.result(timeout=300).token_ids for s in mixed] == alone
    for s in others:
        s.result(timeout=300)
    # and a grammar does not change greedy output when it allows what greedy picks anyway
    free = default_engine.generate([greedy_prompts[0]], SamplingParams(max_tokens=8))[0]
    text_only = StructuredOutput(regex=r"(?s:.*)")
    same = default_engine.generate(
        [greedy_prompts[0]], SamplingParams(max_tokens=8, structured=text_only)
    )[0]
    assert same.token_ids == free.token_ids


def test_a_budget_below_the_shortest_is_refused_and_a_tight_one_closes_validly(default_engine):
    spec, prompt = call_grammar("plot", Plot), [prompt_for(default_engine, "plot")]
    minimum = default_engine.core._grammar_backend().min_tokens(spec)
    with pytest.raises(InvalidRequestError, match=f"takes {minimum}: raise max_tokens"):
        default_engine.generate(prompt, SamplingParams(max_tokens=4, structured=spec))
    for seed, max_tokens in enumerate([minimum, minimum + 5, minimum + 20]):
        sampling = SamplingParams(
            temperature=1.0, seed=seed, max_tokens=max_tokens, structured=spec
        )
        gen = default_engine.generate(prompt, sampling)[0]
        _, calls = ToolCallParser().parse(gen.text)
        Plot.model_validate(calls[0].arguments)
        assert len(gen.token_ids) <= max_tokens
        assert (gen.finish_reason, gen.stop_reason) in (
            ("stop", "grammar"),
            ("length", "grammar_budget"),
        )
    assert gen.stop_reason == "grammar_budget" or len(gen.token_ids) < minimum + 20


def test_bad_grammars_are_rejected_before_scheduling(default_engine):
    steps = default_engine.stats().num_steps
    for bad in (
        StructuredOutput(json_schema={"type": 5}),
        StructuredOutput(grammar="start: undefined_rule"),
        StructuredOutput(regex="(unclosed"),
    ):
        with pytest.raises(InvalidRequestError):
            default_engine.add_request("x", SamplingParams(structured=bad))
    with pytest.raises(InvalidRequestError):
        StructuredOutput(regex="a", choice=("b",))
    with pytest.raises(InvalidRequestError):
        StructuredOutput()
    assert default_engine.stats().num_steps == steps
    assert default_engine.get_num_live_requests() == 0
