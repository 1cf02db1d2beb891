"""A model family's tool-call format: how calls look in its output, once per family.

Each :class:`ToolCallFormat` says what a call block looks like (the text that opens it, how it
ends), how its content decodes into ``(name, arguments)`` entries, how calls render back into
the exact text the model would have written (history), what its ``tool_choice`` grammar is
(``constraints.py`` builds the rules around it) and whether the model's own system prompt or
the chat template lists the tools. The parser and the stream filter (``tool_calls.py``) are
one implementation driven by the format; nothing else branches on the family.

    smollm2      <tool_call>[{"name": "f", "arguments": {...}}, ...]</tool_call>
    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Qwen2.5, one
                 block per call; parallel calls are several blocks)
    llama3_json  {"name": "f", "parameters": {...}}   (bare JSON, optionally after
                 <|python_tag|>; parallel calls are several objects)

The format is chosen per model from its chat template (:func:`detect_tool_call_format`; the
first format, SmolLM2's, is the default) unless named explicitly
(:func:`get_tool_call_format`, from ``EngineConfig.tool_call_format`` or a Session option). It
does not know tools' Python functions, chat templates' rendering or the engine.
"""

from __future__ import annotations

import copy
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from agentx.errors import InvalidRequestError

__all__ = [
    "HermesFormat",
    "Llama3JsonFormat",
    "MalformedCall",
    "SmolLM2Format",
    "TOOL_CALL_FORMATS",
    "ToolCallFormat",
    "detect_tool_call_format",
    "format_for_tokenizer",
    "get_tool_call_format",
]


class MalformedCall(Exception):
    """Why a block's content is not calls; it becomes the call's ``error``."""


class ToolCallFormat(ABC):
    """One family's call syntax. Never mutated (``for_vocabulary`` returns a copy); subclasses
    set the class attributes and keep only what differs: the block shape (``opens``,
    ``close``), the content's decoding and rendering, and the grammar rule for calls.

    ``opens`` are the texts that start a block (the earliest in the text wins). ``close`` ends
    a block when found outside a JSON string; ``None`` means the block ends where its
    top-level JSON value closes (bare JSON, whose opening is part of the content).
    """

    name: ClassVar[str]
    opens: ClassVar[tuple[str, ...]]
    close: ClassVar[str | None]
    arguments_key: ClassVar[str] = "arguments"
    separator: ClassVar[str] = ""  # between the renderings of consecutive groups of calls
    # text that starts a call: a plain answer under "auto"/"none" may not start with these
    # characters nor contain ``opens`` (see constraints.py's TEXT rule)
    text_may_not_start_with: ClassVar[str] = "<"
    # A fenced block (```json ... ```) whose JSON decodes as calls counts as calls; any other
    # stays text. None: fences are only text.
    fence: ClassVar[str | None] = None
    # markup texts that are single added tokens of the model's vocabulary (Qwen2.5's
    # <tool_call>): llguidance treats added tokens as special, never as the text they spell,
    # so a grammar must name them by id or the model has to spell the tag out (and will not)
    markup_token_ids: Mapping[str, int] = {}

    def for_vocabulary(self, added_tokens: Mapping[str, int]) -> ToolCallFormat:
        """This format with ``markup_token_ids`` taken from a vocabulary's added tokens (text
        -> id); the same object when none of its markup is one."""
        markup = [*self.opens, *([self.close] if self.close else [])]
        ids = {text: added_tokens[text] for text in markup if text in added_tokens}
        if not ids:
            return self
        bound = copy.copy(self)
        bound.markup_token_ids = ids
        return bound

    def markup(self, text: str) -> str:
        """A Lark rule body for markup ``text``: the literal, or that or its added token."""
        token_id = self.markup_token_ids.get(text)
        return _lit(text) if token_id is None else f"({_lit(text)} | <[{token_id}]>)"

    @classmethod
    @abstractmethod
    def detects(cls, chat_template: str) -> bool:
        """Whether a chat template is this family's."""

    def tools_system_prompt(self, tools: list[dict[str, Any]]) -> str | None:
        """The model's own function-calling prompt, or None when the chat template renders the
        tools (``template_tools``) itself."""
        return None

    def template_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``Tool.to_dict()`` dicts in the shape the chat template's ``tools`` expects (the
        OpenAI function shape, as transformers passes them), their parameters without the
        validation-only keys (``_brief``): the grammar enforces those, the model need not read
        them, and every turn's prompt is shorter for it."""
        functions = [t.get("function", t) for t in tools]
        return [{"type": "function", "function": f} for f in _brief(functions)]

    @abstractmethod
    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """The text the model writes for well-formed calls (``{"name", "arguments"}`` dicts)."""

    def block_content(self, raw: str) -> str:
        """The JSON text of one complete block (``raw`` includes its markup)."""
        for open_ in self.opens:
            if raw.startswith(open_):
                raw = raw[len(open_) :]
                break
        if self.close is not None and raw.endswith(self.close):
            raw = raw[: -len(self.close)]
        return raw

    def decode_content(self, value: Any) -> list[Any]:
        """The entries (call objects) of a block's decoded JSON value."""
        return [value]

    @abstractmethod
    def calls_grammar(self, parallel_calls: bool) -> str:
        """The Lark rule body for one call (``parallel_calls=False``) or more, over a ``call``
        rule; a ``call`` is ``call_head(name) args call_tail``."""

    def empty_calls(self) -> str | None:
        """A Lark rule body for "no call", which ``"auto"`` also allows; None: no such text."""
        return None

    def call_head(self, name: str) -> str:
        return f'{{"name": {json.dumps(name)}, "{self.arguments_key}": '

    call_tail: ClassVar[str] = "}"

    def unterminated_error(self) -> str:
        opener = self.opens[0]
        closer = self.close or "the JSON object closed"
        return f"unterminated {opener} block: the output ended before {closer}"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


_FORMAT_EXAMPLE = (
    '<tool_call>[{"name": "func_name1", "arguments": '
    '{"argument1": "value1", "argument2": "value2"}}]</tool_call>'
)
_INTRO = (
    "You are an expert in composing functions. You are given a question and a set of functions "
    "you can call. Answer it by making one or more function calls. If none of the functions fits "
    "the question, say so and call none; if the question leaves out an argument that a function "
    "needs, say that too."
)
_FORMAT = (
    "The output MUST strictly adhere to the following format, with no other text. Give every "
    "argument its correct type. If no function call is needed, make the list empty: []\n"
)


def _brief(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool dicts without validation-only schema keys: small models copy what they are shown,
    and an ``additionalProperties`` in the listing comes back as a bogus argument."""
    out = []
    for spec in tools:
        params = spec.get("parameters", {})
        shown = {k: v for k, v in params.items() if k in ("type", "properties", "required")}
        out.append({**spec, "parameters": shown})
    return out


def _lit(text: str) -> str:
    """A Lark string literal (its escapes are JSON's)."""
    return json.dumps(text)


class SmolLM2Format(ToolCallFormat):
    """SmolLM2's: one block holding a JSON list of calls (sometimes a single object)."""

    name = "smollm2"
    opens = ("<tool_call>",)
    close = "</tool_call>"

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        return True  # the default: its template says nothing of tools

    def tools_system_prompt(self, tools: list[dict[str, Any]]) -> str | None:
        listing = f"You have access to the following tools:\n<tools>{_dumps(_brief(tools))}</tools>"
        return "\n\n".join([_INTRO, listing, _FORMAT + _FORMAT_EXAMPLE])

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return f"<tool_call>{_dumps(calls)}</tool_call>" if calls else ""

    def decode_content(self, value: Any) -> list[Any]:
        return value if isinstance(value, list) else [value]

    def calls_grammar(self, parallel_calls: bool) -> str:
        more = ' ("," " "? call)*' if parallel_calls else ""
        open_, close = self.markup("<tool_call>"), self.markup("</tool_call>")
        return f'{open_} "[" call{more} "]" {close}'

    def empty_calls(self) -> str | None:
        # what the tools prompt asks for when no tool fits
        return f'{self.markup("<tool_call>")} "[]" {self.markup("</tool_call>")}'


class HermesFormat(ToolCallFormat):
    """Hermes / Qwen2.5's: one object per block, one block per call, blocks joined by ``\\n``
    (what Qwen's template writes for an assistant turn's ``tool_calls``)."""

    name = "hermes"
    opens = ("<tool_call>",)
    close = "</tool_call>"
    separator = "\n"
    # Qwen2.5-Coder, offered tools with tool_choice="auto", writes its call as a markdown JSON
    # block ({"name": ..., "arguments": ...}) more often than in <tool_call> tags
    fence = "```json"

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        return "<tool_call>" in chat_template and '"arguments"' in chat_template

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"<tool_call>\n{_dumps(call)}\n</tool_call>" for call in calls)

    def calls_grammar(self, parallel_calls: bool) -> str:
        open_, close = self.markup("<tool_call>"), self.markup("</tool_call>")
        block = f'{open_} "\\n" call "\\n" {close}'
        return f"{block} ({_lit(chr(10))} {block})*" if parallel_calls else block


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.1+'s JSON tool calling: a bare ``{"name": ..., "parameters": ...}`` object,
    optionally after ``<|python_tag|>``; several objects (one per line) for parallel calls."""

    name = "llama3_json"
    opens = ("<|python_tag|>", '{"name"')
    close = None
    arguments_key = "parameters"
    separator = "\n"
    text_may_not_start_with = "<{"

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        return "<|python_tag|>" in chat_template or (
            '"parameters"' in chat_template and "<|eot_id|>" in chat_template
        )

    def block_content(self, raw: str) -> str:
        return raw.removeprefix("<|python_tag|>")

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        objects = [{"name": c["name"], "parameters": c["arguments"]} for c in calls]
        return "\n".join(_dumps(o) for o in objects)

    def calls_grammar(self, parallel_calls: bool) -> str:
        return f"call ({_lit(chr(10))} call)*" if parallel_calls else "call"


# The registry, in detection order: the first family whose template test passes is chosen;
# SmolLM2's (the default model's) is the first entry and matches anything, so it is tried last.
TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    f.name: f for f in (SmolLM2Format(), HermesFormat(), Llama3JsonFormat())
}


def detect_tool_call_format(chat_template: str | None) -> ToolCallFormat:
    """The format a chat template's family uses; SmolLM2's when none is recognised."""
    specific = list(TOOL_CALL_FORMATS.values())[1:]
    for fmt in specific:
        if chat_template and fmt.detects(chat_template):
            return fmt
    return next(iter(TOOL_CALL_FORMATS.values()))


def format_for_tokenizer(tokenizer: Any, name: str | None = None) -> ToolCallFormat:
    """The format of a model: ``name``, else the tokenizer's ``tool_call_format`` (from
    ``EngineConfig``), else detected from its chat template; bound to its vocabulary's added
    tokens (``ToolCallFormat.for_vocabulary``)."""
    name = name or getattr(tokenizer, "tool_call_format", None)
    fmt = get_tool_call_format(name, getattr(tokenizer, "chat_template", None))
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
        return fmt
    added = {token.content: i for i, token in backend.get_added_tokens_decoder().items()}
    return fmt.for_vocabulary(added)


def get_tool_call_format(name: str | None, chat_template: str | None = None) -> ToolCallFormat:
    """The format named ``name`` (InvalidRequestError for an unknown one), or the one detected
    from ``chat_template`` when ``name`` is None."""
    if name is None:
        return detect_tool_call_format(chat_template)
    try:
        return TOOL_CALL_FORMATS[name]
    except KeyError:
        known = ", ".join(TOOL_CALL_FORMATS)
        raise InvalidRequestError(f"unknown tool_call_format {name!r} (known: {known})") from None
