"""Turn constraints: ``tool_choice`` and ``response_format`` as grammars the engine enforces.

An agent author asks, as in the OpenAI and Anthropic APIs, for a tool call (``"required"``, or
one named tool), for no tool call (``"none"``), for either (``"auto"``), or for a JSON answer of
a given shape (``response_format``). An in-process engine can guarantee that: it masks every
token the grammar does not allow (``agentx/engine/structured.py``), so a constrained reply
always parses and its arguments validate. This file owns translating those arguments into a
:class:`StructuredOutput` and a :class:`TurnConstraint` (how the session reads the reply). It
does not know the engine, turns or async; grammars last one turn.

Calls are written in the model family's own syntax (its ``ToolCallFormat``, ``tool_formats.py``;
SmolLM2's by default, shown here), one rule per tool::

    start: "<tool_call>[" call ("," " "? call)* "]</tool_call>"
    call: call_0 | call_1
    call_0: "{\\"name\\": \\"add\\", \\"arguments\\": " args_0 "}"
    args_0: %json {...add's parameters, objects closed, compact separators...}

The name and key order are literal text: the format the model was trained on and the one
``render_tool_calls`` writes back into history. Each tool's arguments are a ``%json`` rule of
their own, so a ``$ref`` resolves against the tool's own schema. Objects that list properties
and say nothing of others get ``additionalProperties: false`` (stricter than the schema, never
invalid: a small model otherwise copies schema keys in as arguments), and JSON uses the
``", "`` / ``": "`` separators with no other whitespace (``json.dumps``'s; a small model left
free whitespace may write newlines until ``max_tokens``). Schema keywords llguidance does not
support (an unknown ``format``) are not enforced (``lenient``); ``Tool.invoke`` still checks.

``"auto"`` and ``"none"`` need plain text, "anything that is not a call", approximated as:

    TEXT: /([^<](.|\\n)*)?/ & ~/(.|\\n)*<tool_call>(.|\\n)*/

text that does not start with ``<`` and never contains ``<tool_call>``. A plain reply cannot
begin with ``<`` (HTML, ``<b>``); in exchange a model that starts to write a call under
``"none"`` is turned away at its first token instead of writing ``<tool_cal`` and then
something else. ``"auto"`` is ``start: TEXT | block``, where the block may be empty
(``<tool_call>[]</tool_call>``, what the tools prompt asks for when no tool fits).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from agentx.engine.sampling import SamplingParams
from agentx.engine.structured import COMPACT_JSON, StructuredOutput
from agentx.errors import InvalidRequestError
from agentx.session.tool_formats import ToolCallFormat, get_tool_call_format
from agentx.session.tools import Tool

__all__ = [
    "ResponseFormat",
    "ToolChoice",
    "TurnConstraint",
    "calls_or_answer_constraint",
    "make_turn_constraint",
    "response_format_grammar",
    "tool_call_grammar",
]

Schema = dict[str, Any]
Validator = Callable[[str], Any]
ToolChoice = str | dict[str, Any]  # "auto" | "required" | "none" | {"name": ...} | ...
ResponseFormat = type[BaseModel] | dict[str, Any]  # a model class | a JSON schema | OpenAI's

# llguidance's JSON options, read from the schema's "x-guidance" key: the engine's compact
# separators, and unsupported keywords left to Tool.invoke instead of failing the grammar.
_JSON_OPTIONS = {**COMPACT_JSON, "lenient": True}
_MODES = {"auto": "auto", "required": "required", "any": "required", "none": "none"}

# Where a JSON schema holds subschemas (for closing objects); everything else is data.
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # not allOf: its branches combine
_SUBSCHEMAS = ("items", "additionalProperties", "additionalItems", "not", "contains")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


@dataclass(frozen=True, slots=True)
class TurnConstraint:
    """What one turn's reply must be: the grammar the engine enforces, whether the reply is read
    for tool calls (not a JSON answer: its strings may hold any text), and how a JSON answer
    becomes ``AssistantMessage.parsed``."""

    structured: StructuredOutput
    parse_tool_calls: bool = True
    validate: Validator | None = None

    def sampling_for(self, sampling: SamplingParams, prefill: str | None) -> SamplingParams:
        """``sampling`` with this grammar; raises InvalidRequestError for a prefill (it would
        be part of the prompt, and the grammar would constrain only what follows it) or for
        sampling that already carries a grammar."""
        if prefill:
            raise InvalidRequestError(
                "prefill cannot be combined with tool_choice or response_format: the grammar "
                "decides how the reply starts"
            )
        if sampling.structured is not None:
            raise InvalidRequestError(
                "sampling.structured is already set; pass it or tool_choice/response_format, "
                "not both"
            )
        return replace(sampling, structured=self.structured)


def make_turn_constraint(
    tools: Sequence[Tool],
    tool_choice: ToolChoice | None = None,
    response_format: ResponseFormat | None = None,
    *,
    parallel_calls: bool = True,
    tool_format: ToolCallFormat | None = None,
) -> TurnConstraint | None:
    """The constraint for one turn, None when neither argument is given; without
    ``parallel_calls`` a reply holds at most one call, written in ``tool_format``."""
    if tool_choice is not None and response_format is not None:
        raise InvalidRequestError(
            "tool_choice and response_format cannot be combined: a reply is either tool calls "
            "or a JSON answer"
        )
    if response_format is not None:
        structured, validate = response_format_grammar(response_format)
        return TurnConstraint(structured, parse_tool_calls=False, validate=validate)
    structured = tool_call_grammar(
        tools, tool_choice, parallel_calls=parallel_calls, tool_format=tool_format
    )
    return None if structured is None else TurnConstraint(structured)


# ---- tool_choice -----------------------------------------------------------------------------


def tool_call_grammar(
    tools: Sequence[Tool],
    choice: ToolChoice | None,
    *,
    parallel_calls: bool = True,
    tool_format: ToolCallFormat | None = None,
) -> StructuredOutput | None:
    """The grammar for ``tool_choice``: ``"auto"``, ``"required"``, ``"none"``, ``{"name": X}``
    (also OpenAI's ``{"type": "function", "function": {"name": X}}`` and Anthropic's
    ``{"type": "auto" | "any" | "none"}`` / ``{"type": "tool", "name": X}``); None for None.

    ``"auto"`` without tools is ``"none"``. Raises InvalidRequestError for a bad value, a named
    tool that is not declared, or ``"required"`` / a named tool without tools.
    """
    if choice is None:
        return None
    fmt = tool_format or get_tool_call_format(None)
    mode, name = _parse_choice(choice)
    if mode == "none" or (mode == "auto" and not tools):
        return StructuredOutput(grammar=f"start: TEXT\n{_text_rule(fmt)}\n")
    if not tools:
        raise InvalidRequestError(f"tool_choice={choice!r} needs tools; none are declared")
    chosen = list(tools)
    if mode == "named":
        chosen = [t for t in tools if t.name == name]
        if not chosen:
            known = ", ".join(t.name for t in tools)
            raise InvalidRequestError(
                f"tool_choice names {name!r}, which is not a declared tool (tools: {known})"
            )
    grammar = _calls_grammar(fmt, chosen, mode == "auto", parallel_calls=parallel_calls)
    return StructuredOutput(grammar=grammar)


def _parse_choice(choice: Any) -> tuple[str, str | None]:
    """``(mode, name)``: mode is auto, required, none or named (then ``name`` is set)."""
    if isinstance(choice, str) and choice in _MODES:
        return _MODES[choice], None
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind in _MODES and "name" not in choice:
            return _MODES[kind], None
        target = choice.get("function") if kind == "function" else choice  # OpenAI nests it
        name = target.get("name") if isinstance(target, dict) else None
        if kind in (None, "function", "tool") and isinstance(name, str):
            return "named", name
    raise InvalidRequestError(
        "tool_choice must be 'auto', 'required', 'none', {'name': ...} or "
        f"{{'type': 'function', 'function': {{'name': ...}}}}; got {choice!r}"
    )


def _calls_grammar(
    fmt: ToolCallFormat,
    tools: list[Tool],
    allow_text: bool,
    answer: Schema | None = None,
    parallel_calls: bool = True,
) -> str:
    """Calls to ``tools`` in ``fmt`` (one only without ``parallel_calls``); with
    ``allow_text`` or plain text, or with ``answer`` (a compiled JSON schema) or that answer."""
    calls = fmt.calls_grammar(parallel_calls)
    if allow_text:
        empty = fmt.empty_calls()
        lines = ["start: TEXT | block", f"block: {calls}" + (f" | {empty}" if empty else "")]
    elif answer is not None:
        lines = ["start: answer | block", f"block: {calls}"]
        lines.append(f"answer: %json {json.dumps(answer)}")
    else:
        lines = [f"start: {calls}"]
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        head, tail = _literal(fmt.call_head(tool.name)), _literal(fmt.call_tail)
        lines.append(f"call_{i}: {head} args_{i} {tail}")
        lines.append(f"args_{i}: %json {json.dumps(_json_schema(tool.parameters))}")
    if allow_text:
        lines.append(_text_rule(fmt))
    return "\n".join(lines) + "\n"


def _text_rule(fmt: ToolCallFormat) -> str:
    """Plain text: not starting with a character a call starts with, never holding a call's
    opening."""
    first = re.escape(fmt.text_may_not_start_with)
    opens = "|".join(re.escape(o) for o in fmt.opens)
    opens = opens if len(fmt.opens) == 1 else f"({opens})"
    return rf"TEXT: /([^{first}](.|\n)*)?/ & ~/(.|\n)*{opens}(.|\n)*/"


def _literal(text: str) -> str:
    """A Lark string literal (its escapes are JSON's)."""
    return json.dumps(text)


def calls_or_answer_constraint(
    tools: Sequence[Tool],
    response_format: ResponseFormat,
    *,
    parallel_calls: bool = True,
    tool_format: ToolCallFormat | None = None,
) -> TurnConstraint:
    """``tool_choice="auto"`` together with ``response_format`` (what the OpenAI API allows
    and agent frameworks send for an agent with tools and a typed output): the reply is tool
    calls or the JSON answer, never free text. Read for tool calls; a JSON answer is left as
    text (``validate`` is None: a reply that is calls has nothing to validate)."""
    structured, validate = response_format_grammar(response_format)
    if not tools:
        return TurnConstraint(structured, parse_tool_calls=False, validate=validate)
    fmt = tool_format or get_tool_call_format(None)
    answer = structured.json_schema
    grammar = _calls_grammar(fmt, list(tools), False, answer=answer, parallel_calls=parallel_calls)
    return TurnConstraint(StructuredOutput(grammar=grammar))


# ---- response_format -------------------------------------------------------------------------


def response_format_grammar(
    response_format: ResponseFormat,
) -> tuple[StructuredOutput, Validator]:
    """The grammar and validator for ``response_format``: a pydantic model class (the reply
    validates into an instance), a JSON schema dict, or OpenAI's ``{"type": "json_schema",
    "json_schema": {"schema": {...}}}`` / ``{"type": "json_object"}`` (both parse to a dict with
    ``json.loads``; the grammar is what enforces the schema)."""
    if isinstance(response_format, type) and issubclass(response_format, BaseModel):
        schema = response_format.model_json_schema()
        validate: Validator = response_format.model_validate_json
    elif isinstance(response_format, dict):
        schema, validate = _schema_of(response_format), json.loads
    else:
        raise InvalidRequestError(
            "response_format must be a pydantic model class or a JSON schema dict, "
            f"got {response_format!r}"
        )
    return StructuredOutput(json_schema=_json_schema(schema)), validate


def _schema_of(response_format: Schema) -> Schema:
    kind = response_format.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        return response_format
    schema = (response_format.get("json_schema") or {}).get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            "a response_format of type 'json_schema' needs a 'json_schema': {'schema': {...}} dict"
        )
    return schema


# ---- JSON schemas ----------------------------------------------------------------------------


def _json_schema(schema: Schema) -> Schema:
    """A copy to compile: objects closed, llguidance's options set (the caller's win)."""
    closed = _closed(schema)
    closed["x-guidance"] = {**_JSON_OPTIONS, **schema.get("x-guidance", {})}
    return closed


def _closed(schema: Any) -> Any:
    """A copy of ``schema`` in which every object that lists properties and says nothing of
    other keys forbids them. Data (``const``, ``enum``, ``default``) is never walked."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema  # a boolean schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in (*_SUBSCHEMA_LISTS, *_SUBSCHEMAS):
        if key in out:
            out[key] = _closed(out[key])
    if "properties" in out and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out
