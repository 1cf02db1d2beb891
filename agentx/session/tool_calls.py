"""Tool calls in model output: parsing them, whole or streamed, and writing them back.

What a call looks like is the model family's :class:`ToolCallFormat` (``tool_formats.py``;
SmolLM2's by default)::

    <tool_call>[{"name": "fn", "arguments": {"a": 1}}]</tool_call>          smollm2
    <tool_call>\n{"name": "fn", "arguments": {"a": 1}}\n</tool_call>        hermes (Qwen2.5)
    {"name": "fn", "parameters": {"a": 1}}                                  llama3_json

This file owns parsing calls out of model output, whole (``ToolCallParser``) or streamed
(``ToolCallStreamFilter``), and rendering calls back into the exact text the model would have
produced (to re-render history). Parsing never raises on bad markup: a broken block becomes one
``ToolCall`` with ``error`` set. It does not know tools' Python functions nor chat templates.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Callable
from typing import Any

from agentx.session.messages import ToolCall
from agentx.session.tool_formats import (
    MalformedCall,
    SmolLM2Format,
    ToolCallFormat,
    detect_tool_call_format,
)

__all__ = [
    "ToolCallParser",
    "ToolCallStreamFilter",
    "render_raw_call",
    "render_tool_calls",
    "render_tools_system_prompt",
]

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # SmolLM2's and Hermes's block markup
_DEFAULT_FORMAT = SmolLM2Format()
_FENCE_CLOSE = "```"
_NAME_GUESS = re.compile(r"""["']name["']\s*:\s*["']([^"']+)["']""")


def render_tools_system_prompt(tools: list[dict[str, Any]], base: str | None = None) -> str:
    """SmolLM2's function-calling system prompt for ``tools`` (``Tool.to_dict()`` dicts) +
    ``base``."""
    prompt = _DEFAULT_FORMAT.tools_system_prompt(tools)
    return f"{prompt}\n\n{base}" if base else prompt


def render_tool_calls(calls: list[ToolCall], tool_format: ToolCallFormat | None = None) -> str:
    """The text the model would have produced for ``calls``: consecutive well-formed calls are
    rendered together (SmolLM2: one block), a malformed call is replayed as its ``raw`` text."""
    fmt = tool_format or _DEFAULT_FORMAT
    parts: list[str] = []
    batch: list[dict[str, Any]] = []
    for call in calls:
        if call.ok:
            batch.append({"name": call.name, "arguments": call.arguments})
            continue
        parts += [fmt.render_calls(batch), call.raw]
        batch = []
    parts.append(fmt.render_calls(batch))
    return fmt.separator.join(part for part in parts if part)


def render_raw_call(
    name: str, arguments_text: str, tool_format: ToolCallFormat | None = None
) -> str:
    """The markup of one call whose arguments are given as text, written as it is (a client's
    arguments that are not a JSON object, replayed into history)."""
    fmt = tool_format or _DEFAULT_FORMAT
    placeholder = "\x00arguments\x00"
    rendered = fmt.render_calls([{"name": name, "arguments": placeholder}])
    return rendered.replace(json.dumps(placeholder, ensure_ascii=False), arguments_text)


def _random_call_id() -> str:
    return "call_" + secrets.token_hex(6)


class ToolCallParser:
    """Turns call blocks of ``tool_format`` (SmolLM2's by default) into ``ToolCall``s;
    ``id_factory`` names every call made, malformed ones included (the agent answers each with
    a ``ToolMessage``)."""

    def __init__(
        self,
        id_factory: Callable[[], str] | None = None,
        tool_format: ToolCallFormat | None = None,
    ) -> None:
        self.id_factory = id_factory or _random_call_id
        self.format = tool_format or _DEFAULT_FORMAT

    @classmethod
    def for_template(cls, chat_template: str | None) -> ToolCallParser:
        """A parser for the format detected from ``chat_template``."""
        return cls(tool_format=detect_tool_call_format(chat_template))

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The plain text outside the blocks (verbatim, whitespace kept) and the calls found."""
        stream = ToolCallStreamFilter(self)
        head = stream.push(text)
        tail, calls = stream.finish()
        return head + tail, calls

    def parse_block(self, raw: str) -> list[ToolCall]:
        """The calls of one complete block; ``raw`` includes its markup."""
        try:
            entries = self._decode_entries(self.format.block_content(raw))
        except MalformedCall as exc:
            return [self.malformed(raw, str(exc))]
        return [ToolCall(id=self.id_factory(), name=n, arguments=a) for n, a in entries]

    def parse_fenced(self, raw: str) -> list[ToolCall] | None:
        """The calls of a complete fenced block (``raw`` includes both fences), or None when its
        content is not calls (then it is text)."""
        content = raw[len(self.format.fence or "") : -len(_FENCE_CLOSE)]
        try:
            entries = self._decode_entries(content)
        except MalformedCall:
            return None
        return [ToolCall(id=self.id_factory(), name=n, arguments=a) for n, a in entries]

    def malformed(self, raw: str, error: str) -> ToolCall:
        guess = _NAME_GUESS.search(raw)
        name = guess[1] if guess else ""
        return ToolCall(id=self.id_factory(), name=name, raw=raw, error=error)

    def _decode_entries(self, content: str) -> list[tuple[str, dict[str, Any]]]:
        content = content.strip()
        if not content:
            raise MalformedCall(f"empty {self.format.opens[0]} block")
        entries = self.format.decode_content(_loads(content))
        return [_decode_entry(i, entry) for i, entry in enumerate(entries)]


def _loads(content: str) -> Any:
    try:
        return json.loads(content)
    except json.JSONDecodeError as exc:
        json_error = exc
    except RecursionError:  # ~1,000 nested brackets: model output, not a call
        raise MalformedCall("invalid JSON: nested too deeply") from None
    try:
        # Small models sometimes write Python dicts ('single quotes', True). literal_eval only
        # evaluates literals; the JSON round trip rejects what JSON cannot hold (sets, bytes).
        return json.loads(json.dumps(ast.literal_eval(content)))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise MalformedCall(f"invalid JSON: {json_error}") from None


def _decode_entry(index: int, entry: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(entry, dict):
        raise MalformedCall(f"tool call {index} is not an object")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedCall(f'tool call {index} has no "name" string')
    arguments = entry.get("arguments", entry.get("parameters"))
    if arguments is None:
        return name, {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            raise MalformedCall(f"arguments of {name!r} are a string that is not JSON") from None
    if not isinstance(arguments, dict):
        raise MalformedCall(
            f"arguments of {name!r} must be an object, got {type(arguments).__name__}"
        )
    return name, arguments


class ToolCallStreamFilter:
    """Splits streamed model output into plain text to show now and tool calls.

    ``push`` returns only text that can no longer be part of a block: a tail that could still
    grow into a block's opening (``<tool_call>``) is held back, and block markup is never shown.
    Calls are available from ``take_calls`` as soon as their block ends; ``finish`` flushes the
    held-back text and turns an unterminated block into a malformed call. The shown text and
    the calls equal what ``ToolCallParser.parse`` returns for the whole output, however it was
    split.

    A closing tag inside a JSON string of the block (a patch that edits this very markup:
    valid JSON, and what a grammar allows) does not close it; if the output ends with the block
    still open, it is split at the first closing tag after all, as markup with an unterminated
    string always was. A format without a closing tag (bare JSON) ends a block where its
    top-level JSON value closes.
    """

    def __init__(self, parser: ToolCallParser | None = None) -> None:
        self.parser = parser or ToolCallParser()
        self._format = self.parser.format
        self._pending = ""  # held-back text: a possible start of a block, or an open block so far
        self._in_block = False
        self._scan = _JsonScan(self._format.close)  # where an open block ends, pushes linear
        fence = self._format.fence
        self._opens = self._format.opens + ((fence,) if fence else ())
        self._fenced = False  # the open block is a fenced one (text unless it holds calls)
        self._calls: list[ToolCall] = []
        self._num_taken = 0
        self._finished = False

    def push(self, delta: str) -> str:
        if self._finished:
            raise RuntimeError("push() after finish()")
        self._pending += delta
        shown: list[str] = []
        while self._advance(shown):
            pass
        return "".join(shown)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The held-back plain text and every call of the stream (taken or not)."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        tail, self._pending = self._pending, ""
        if not self._in_block or self._fenced:  # an unclosed fence is text
            return tail, list(self._calls)
        close = self._format.close
        end = tail.find(close) if close is not None else -1
        if end >= 0:  # every close sat in a string that never ended: the first one closes
            end += len(close)
            self._calls += self.parser.parse_block(tail[:end])
            rest = ToolCallStreamFilter(self.parser)
            shown = rest.push(tail[end:])
            more, calls = rest.finish()
            self._calls += calls
            return shown + more, list(self._calls)
        self._calls.append(self.parser.malformed(tail, self._format.unterminated_error()))
        return "", list(self._calls)

    def take_calls(self) -> list[ToolCall]:
        """Calls completed since the last take."""
        new = self._calls[self._num_taken :]
        self._num_taken = len(self._calls)
        return new

    def _advance(self, shown: list[str]) -> bool:
        """Consume what the pending text decides; False when it needs more text."""
        if self._in_block:
            end = self._scan.find_end(self._pending)
            if end < 0:
                return False
            raw = self._pending[:end]
            calls = self.parser.parse_fenced(raw) if self._fenced else self.parser.parse_block(raw)
            if calls is None:
                shown.append(raw)
            else:
                self._calls += calls
            self._pending, self._in_block = self._pending[end:], False
            return True
        found = [(i, o) for o in self._opens if (i := self._pending.find(o)) >= 0]
        if not found:
            cut = len(self._pending) - _partial_open_size(self._pending, self._opens)
            shown.append(self._pending[:cut])
            self._pending = self._pending[cut:]
            return False
        start, open_ = min(found)
        shown.append(self._pending[:start])
        self._pending, self._in_block = self._pending[start:], True
        # a closing tag is looked for after the opening; bare JSON is scanned from its start
        self._fenced = open_ == self._format.fence
        close = _FENCE_CLOSE if self._fenced else self._format.close
        self._scan = _JsonScan(close, len(open_) if close is not None else 0)
        return True


class _JsonScan:
    """Where an open block's text has been scanned to: whether that point is inside a JSON
    string (double quotes, backslash escapes) and how deep in brackets."""

    __slots__ = ("close", "depth", "escaped", "in_string", "position")

    def __init__(self, close: str | None, position: int = 0) -> None:
        self.close = close
        self.position = position
        self.in_string = False
        self.escaped = False
        self.depth = 0

    def find_end(self, text: str) -> int:
        """Index just past the block's end (the first ``close`` outside a string, or with no
        ``close`` the bracket that closes the top-level value), or -1 (scanning resumes where
        it ended, short of a possible closing tag still arriving)."""
        close, k = self.close, self.position
        while k < len(text):
            ch = text[k]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif close is None and ch in "{[":
                self.depth += 1
            elif close is None and ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.position = k + 1
                    return k + 1
            elif close is not None and ch == close[0] and text.startswith(close, k):
                self.position = k
                return k + len(close)
            elif close is not None and ch == close[0] and close.startswith(text[k:]):
                break  # may be a closing tag still arriving
            k += 1
        self.position = k
        return -1


def _partial_open_size(text: str, opens: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``opens``."""
    best = 0
    for open_ in opens:
        for size in range(min(len(open_) - 1, len(text)), best, -1):
            if text.endswith(open_[:size]):
                best = size
                break
    return best
