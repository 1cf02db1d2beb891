"""Budget-aware grammars: driven by random token choices (uniform over the tokens the mask
allows, half the time only among its short ones, which opens strings, lists and objects far
more often than a model does), every output over schemas with unbounded strings, lists and
nesting parses and validates within max_tokens, from the shortest output's length up to a few
hundred tokens; outputs the budget closed say so; a budget below the shortest is refused.
The default model's tokenizer, no weights; ``slow`` tests run the real model."""

from __future__ import annotations

import asyncio
import random
import re
from typing import Literal

import numpy as np
import pytest
import torch
from pydantic import BaseModel, TypeAdapter, validate_call

from agentx import InvalidRequestError, SamplingParams, Session
from agentx.engine.models.loader import default_model_path
from agentx.engine.models.tokenizer import Tokenizer
from agentx.engine.structured import GrammarBackend, StructuredOutput
from agentx.session.constraints import response_format_grammar, tool_call_grammar
from agentx.session.tool_calls import ToolCallParser
from agentx.session.tools import Tool, make_tools
from tests.helpers.grammar import Walk, sample_any, sample_short

NUM_SEEDS = 200


class Hunk(BaseModel):
    start_line: int
    replacement: list[str]


def patch(path: str, mode: Literal["replace", "insert", "delete"], hunks: list[Hunk]) -> str:
    """Patch a file."""
    return f"{mode} {path}: {len(hunks)} hunks"


def note(title: str, tags: list[str], body: str | None = None) -> str:
    """Write a note."""
    return title


PATCH_TOOLS = list(make_tools([patch]).values())
TWO_TOOLS = list(make_tools([patch, note]).values())


class Cell(BaseModel):
    text: str
    score: float | None = None
    flags: list[bool] = []


class Table(BaseModel):
    """Nesting three deep, every level unbounded."""

    name: str
    rows: list[list[Cell]]
    meta: dict[str, list[str]]


TREE_LARK = r"""
start: node
node: "(" NAME (" " node)* ")"
NAME: /[a-z]+/
"""
EMAIL = r"[a-z]+(\.[a-z]+)*@[a-z]+\.(com|org)"


def _tree_ok(text: str) -> bool:
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and i != len(text) - 1:
            return False
    return depth == 0 and re.fullmatch(r"[a-z() ]+", text) is not None


def _calls_ok(tools: list[Tool]):
    by_name = {t.name: validate_call(t.fn) for t in tools}  # validates, then runs (cheap)
    parser = ToolCallParser()

    def check(text: str) -> bool:
        rest, calls = parser.parse(text)
        if rest.strip() or not calls or not all(c.ok for c in calls):
            return False
        for call in calls:
            by_name[call.name](**call.arguments)
        return True

    return check


def _model_ok(model: type[BaseModel]):
    def check(text: str) -> bool:
        model.model_validate_json(text)
        return True

    return check


CASES = {
    "patch_tool": (tool_call_grammar(PATCH_TOOLS, "required"), _calls_ok(PATCH_TOOLS)),
    "two_tools_parallel": (tool_call_grammar(TWO_TOOLS, "required"), _calls_ok(TWO_TOOLS)),
    "response_format": (response_format_grammar(Table)[0], _model_ok(Table)),
    "json_schema": (
        StructuredOutput(json_schema={"type": "array", "items": {"type": "array"}}),
        lambda text: TypeAdapter(list[list]).validate_json(text) is not None,
    ),
    "regex": (StructuredOutput(regex=EMAIL), lambda text: re.fullmatch(EMAIL, text) is not None),
    "lark": (StructuredOutput(grammar=TREE_LARK), _tree_ok),
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def backend(tokenizer) -> GrammarBackend:
    return GrammarBackend(
        tokenizer.backend.to_str(), tokenizer.vocab_size, frozenset(tokenizer.eos_token_ids)
    )


@pytest.fixture(scope="module")
def short_tokens(tokenizer) -> np.ndarray:
    """Ids of the tokens of one or two characters: the ones that open and close structure."""
    size = tokenizer.vocab_size
    return np.array([i for i in range(size) if len(tokenizer.token_to_text(i)) <= 2])


def budgets(minimum: int) -> list[int]:
    """One budget per seed: from the minimum to minimum + 59 (150 seeds), then a spread to
    minimum + 299 (the rest)."""
    return [minimum + (s % 60 if s < 150 else 60 + (s * 37) % 240) for s in range(NUM_SEEDS)]


@pytest.mark.parametrize("case", list(CASES))
def test_every_output_is_valid_within_its_budget(backend, tokenizer, short_tokens, case):
    spec, valid = CASES[case]
    minimum = backend.min_tokens(spec)
    assert minimum is not None
    num_closed = 0
    for seed, max_tokens in enumerate(budgets(minimum)):
        matcher = backend.new_matcher(spec, max_tokens)
        walk = Walk(backend, matcher, short_tokens, seed)
        text = tokenizer.decode(walk.token_ids)
        assert matcher.is_accepting and not matcher.error, (seed, max_tokens, text)
        assert len(walk.token_ids) <= max_tokens
        assert valid(text), (seed, max_tokens, text)
        if walk.token_ids != walk.sampled:
            assert matcher.budget_closed, (seed, text)  # a swapped token says so
        num_closed += matcher.budget_closed
    assert 0 < num_closed < NUM_SEEDS or case in ("regex", "lark")


SHORTEST_CALL = (
    '<tool_call>[{"name": "patch", "arguments": {"path": "", "mode": "replace", "hunks": []}}]'
    "</tool_call>"
)


def test_the_shortest_output_and_a_budget_below_it(backend, tokenizer, short_tokens):
    spec = CASES["patch_tool"][0]
    assert backend.min_tokens(spec) == 37
    with pytest.raises(InvalidRequestError, match="shortest output .* takes 37.* at least 37"):
        backend.new_matcher(spec, 36)
    matcher = backend.new_matcher(spec, 37)  # no slack from the first token: all forced
    walk = Walk(backend, matcher, short_tokens, seed=0)
    assert tokenizer.decode(walk.token_ids) == SHORTEST_CALL and len(walk.token_ids) == 37
    assert matcher.is_terminated and matcher.budget_closed  # the path could have had text
    assert backend.min_tokens(StructuredOutput(json_schema={"type": "object"})) == 1  # "{}"
    assert backend.min_tokens(StructuredOutput(regex=r"[0-9]{3}-[0-9]{4}")) == 8
    assert backend.min_tokens(StructuredOutput(choice=("blue", "green"))) == 1
    assert backend.new_matcher(spec).budget is None  # no max_tokens, no budget


@pytest.mark.parametrize("case", ["patch_tool", "response_format"])
def test_closed_says_exactly_when_the_budget_decided(backend, short_tokens, case):
    """``budget_closed`` is set iff a token was swapped or a mask held fewer tokens than the
    grammar's own (a plain matcher fed the same tokens)."""
    spec = CASES[case][0]
    minimum = backend.min_tokens(spec)
    rows = backend.allocate_bitmask(2)
    outcomes = set()
    for seed in range(30):
        matcher = backend.new_matcher(spec, minimum + seed * 3)
        plain = backend.new_matcher(spec)
        decided = False
        rng = random.Random(seed)
        while matcher.budget.num_left > 0 and not matcher.is_terminated:
            matcher.fill_bitmask(rows, 0)
            plain.fill_bitmask(rows, 1)
            decided |= not torch.equal(rows[0], rows[1])
            words = rows[0].numpy().view(np.uint32)
            sampled = sample_short(rng, words, short_tokens) if rng.random() < 0.5 else None
            if sampled is None:
                sampled = sample_any(rng, words, backend.vocab_size)
            token_id = matcher.commit(sampled)
            decided |= token_id != sampled
            assert plain.accept(token_id)
        assert matcher.budget_closed == decided and matcher.is_accepting
        outcomes.add(decided)
    assert outcomes == {True, False}


# ---- the real model ---------------------------------------------------------------------------

slow = pytest.mark.slow
ASK_PATCH = "In src/app.py, replace lines 3 and 7 with a logging call and a docstring."


@slow
async def test_patch_tool_turns_all_end_valid(default_engine):
    """The issue's case (an unbounded patch tool, ``tool_choice="required"``, temperature 1.0,
    max_tokens 160; 13 of seeds 0-29 validated before budgets), on 8 seeds to stay quick
    (``benchmarks/grammar_budget_bench.py`` runs all 30): every turn's calls parse and
    validate; the ones the budget closed finish with "length"."""
    async with Session(default_engine, tools=[patch]) as base:

        async def turn(seed: int):
            async with await base.fork() as s:
                sampling = SamplingParams(temperature=1.0, seed=seed, max_tokens=160)
                return await s.send(ASK_PATCH, tool_choice="required", sampling=sampling)

        replies = await asyncio.gather(*(turn(seed) for seed in range(8)))
    validate = validate_call(patch)
    for reply in replies:
        assert reply.content == "" and reply.tool_calls
        assert reply.finish_reason in ("stop", "length") and reply.usage.output_tokens <= 160
        for call in reply.tool_calls:
            assert call.ok, call.error
            validate(**call.arguments)
    assert {r.finish_reason for r in replies} == {"stop", "length"}


@slow
def test_engine_reports_budget_closed_outputs(default_engine):
    tok = default_engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "A table?"}]))
    spec = CASES["response_format"][0]
    with pytest.raises(InvalidRequestError, match="at least"):
        default_engine.add_request(prompt, SamplingParams(max_tokens=3, structured=spec))
    sampling = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=24, structured=spec) for s in range(4)
    ]
    for gen in [default_engine.generate([prompt], p)[0] for p in sampling]:
        Table.model_validate_json(gen.text)
        assert (gen.finish_reason, gen.stop_reason) in (
            ("stop", "grammar"),
            ("length", "grammar_budget"),
        )
    default_engine.check_integrity()


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},  # itself, forever
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    ],
    ids=["self-ref", "ref-cycle", "required-recursion"],
)
def test_a_schema_with_no_finite_output_is_refused_at_submit(backend, schema):
    """Was: compiled, then failed while it ran (finish_reason "error", reported as "stop")."""
    with pytest.raises(InvalidRequestError, match="invalid structured output"):
        backend.new_matcher(StructuredOutput(json_schema=schema), 32)


def test_thousands_of_choices_run(backend, tokenizer):
    """Was: 2,000+ choices overflowed llguidance's parser row at run time."""
    spec = StructuredOutput(choice=tuple(f"option-{i}" for i in range(5000)))
    matcher = backend.new_matcher(spec, 32)
    assert backend.min_tokens(spec) == 3  # "option", "-", "0"
    for token_id in tokenizer.encode("option-4999", add_special_tokens=False):
        assert matcher.commit(token_id) == token_id and not matcher.is_error
    assert matcher.is_accepting and not matcher.budget_closed


def test_counted_items_are_refused_below_the_budget_they_need(backend, tokenizer, short_tokens):
    """minItems is invisible to the token mask (the 30th item looks like the 1st): the search
    used to give up and the request ran without a guarantee."""
    spec = StructuredOutput(json_schema={"type": "array", "minItems": 30})
    minimum = backend.min_tokens(spec)
    assert minimum is not None and 59 <= minimum  # "[", 30 items and 29 separators, "]"
    with pytest.raises(InvalidRequestError, match=f"at least {minimum}"):
        backend.new_matcher(spec, 32)
    matcher = backend.new_matcher(spec, minimum)
    walk = Walk(backend, matcher, short_tokens, seed=0)
    items = TypeAdapter(list).validate_json(tokenizer.decode(walk.token_ids))
    assert len(items) >= 30 and len(walk.token_ids) <= minimum


def test_a_rare_way_out_is_found_and_kept(backend, tokenizer, short_tokens):
    """``[^x]*xyz``: every token but those with an "x" keeps the start state; the search tried
    12 and gave up, so 8 tokens ran out before the "xyz" (no guarantee)."""
    spec = StructuredOutput(regex="[^x]*xyz")
    assert backend.min_tokens(spec) <= 3
    for seed in range(20):
        matcher = backend.new_matcher(spec, 8)
        walk = Walk(backend, matcher, short_tokens, seed)
        text = tokenizer.decode(walk.token_ids)
        assert re.fullmatch("[^x]*xyz", text, re.DOTALL) and len(walk.token_ids) <= 8, text
