"""The default model's own tool-call format (SmolLM2's): how tools are offered, how calls look.

The system prompt lists the tools as JSON inside ``<tools>...</tools>`` and the model answers::

    <tool_call>[{"name": "fn", "arguments": {"a": 1}}]</tool_call>

(a JSON list, sometimes a single object). This file owns rendering that prompt, rendering calls
back into the exact text the model would have produced (to re-render history), and parsing them
out of model output, whole (``ToolCallParser``) or streamed (``ToolCallStreamFilter``). Parsing
never raises on bad markup: a broken block becomes one ``ToolCall`` with ``error`` set. It does
not know tools' Python functions nor chat templates.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Callable
from typing import Any

from agentx.session.messages import ToolCall

__all__ = [
    "ToolCallParser",
    "ToolCallStreamFilter",
    "render_tool_calls",
    "render_tools_system_prompt",
]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME_GUESS = re.compile(r"""["']name["']\s*:\s*["']([^"']+)["']""")
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


def render_tools_system_prompt(tools: list[dict[str, Any]], base: str | None = None) -> str:
    """The function-calling system prompt for ``tools`` (``Tool.to_dict()`` dicts) + ``base``."""
    listing = f"You have access to the following tools:\n<tools>{_dumps(_brief(tools))}</tools>"
    prompt = "\n\n".join([_INTRO, listing, _FORMAT + _FORMAT_EXAMPLE])
    return f"{prompt}\n\n{base}" if base else prompt


def _brief(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool dicts without validation-only schema keys: small models copy what they are shown,
    and an ``additionalProperties`` in the listing comes back as a bogus argument."""
    out = []
    for spec in tools:
        params = spec.get("parameters", {})
        shown = {k: v for k, v in params.items() if k in ("type", "properties", "required")}
        out.append({**spec, "parameters": shown})
    return out


def render_tool_calls(calls: list[ToolCall]) -> str:
    """The text the model would have produced for ``calls``: consecutive well-formed calls share
    one block, a malformed call is replayed as its ``raw`` text."""
    parts: list[str] = []
    batch: list[dict[str, Any]] = []
    for call in calls:
        if call.ok:
            batch.append({"name": call.name, "arguments": call.arguments})
            continue
        parts += [_block(batch), call.raw]
        batch = []
    parts.append(_block(batch))
    return "".join(parts)


def _block(batch: list[dict[str, Any]]) -> str:
    return f"{OPEN}{_dumps(batch)}{CLOSE}" if batch else ""


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _random_call_id() -> str:
    return "call_" + secrets.token_hex(6)


class _Malformed(Exception):
    """Why a block's content is not a list of calls; it becomes the call's ``error``."""


class ToolCallParser:
    """Turns ``<tool_call>`` blocks into ``ToolCall``s; ``id_factory`` names every call made,
    malformed ones included (the agent answers each with a ``ToolMessage``)."""

    def __init__(self, id_factory: Callable[[], str] | None = None) -> None:
        self.id_factory = id_factory or _random_call_id

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The plain text outside the blocks (verbatim, whitespace kept) and the calls found."""
        stream = ToolCallStreamFilter(self)
        head = stream.push(text)
        tail, calls = stream.finish()
        return head + tail, calls

    def parse_block(self, raw: str) -> list[ToolCall]:
        """The calls of one complete block; ``raw`` includes both tags."""
        try:
            entries = _decode_entries(raw[len(OPEN) : -len(CLOSE)])
        except _Malformed as exc:
            return [self.malformed(raw, str(exc))]
        return [ToolCall(id=self.id_factory(), name=n, arguments=a) for n, a in entries]

    def malformed(self, raw: str, error: str) -> ToolCall:
        guess = _NAME_GUESS.search(raw)
        name = guess[1] if guess else ""
        return ToolCall(id=self.id_factory(), name=name, raw=raw, error=error)


def _decode_entries(content: str) -> list[tuple[str, dict[str, Any]]]:
    content = content.strip()
    if not content:
        raise _Malformed(f"empty {OPEN} block")
    value = _loads(content)
    entries = value if isinstance(value, list) else [value]
    return [_decode_entry(i, entry) for i, entry in enumerate(entries)]


def _loads(content: str) -> Any:
    try:
        return json.loads(content)
    except json.JSONDecodeError as exc:
        json_error = exc
    except RecursionError:  # ~1,000 nested brackets: model output, not a call
        raise _Malformed("invalid JSON: nested too deeply") from None
    try:
        # Small models sometimes write Python dicts ('single quotes', True). literal_eval only
        # evaluates literals; the JSON round trip rejects what JSON cannot hold (sets, bytes).
        return json.loads(json.dumps(ast.literal_eval(content)))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _Malformed(f"invalid JSON: {json_error}") from None


def _decode_entry(index: int, entry: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(entry, dict):
        raise _Malformed(f"tool call {index} is not an object")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise _Malformed(f'tool call {index} has no "name" string')
    arguments = entry.get("arguments", entry.get("parameters"))
    if arguments is None:
        return name, {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            raise _Malformed(f"arguments of {name!r} are a string that is not JSON") from None
    if not isinstance(arguments, dict):
        raise _Malformed(f"arguments of {name!r} must be an object, got {type(arguments).__name__}")
    return name, arguments


class ToolCallStreamFilter:
    """Splits streamed model output into plain text to show now and tool calls.

    ``push`` returns only text that can no longer be part of a block: a tail that could still
    grow into ``<tool_call>`` is held back, and block markup is never shown. Calls are available
    from ``take_calls`` as soon as their block closes; ``finish`` flushes the held-back text and
    turns an unterminated block into a malformed call. The shown text and the calls equal what
    ``ToolCallParser.parse`` returns for the whole output, however it was split.

    A ``</tool_call>`` inside a JSON string of the block (a patch that edits this very markup:
    valid JSON, and what a grammar allows) does not close it; if the output ends with the block
    still open, it is split at the first ``</tool_call>`` after all, as markup with an
    unterminated string always was.
    """

    def __init__(self, parser: ToolCallParser | None = None) -> None:
        self.parser = parser or ToolCallParser()
        self._pending = ""  # held-back text: a possible start of OPEN, or an open block so far
        self._in_block = False
        self._scan = _JsonScan()  # where CLOSE may start in an open block, so pushes stay linear
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
        if not self._in_block:
            return tail, list(self._calls)
        end = tail.find(CLOSE)
        if end >= 0:  # every CLOSE sat in a string that never ended: the first one closes
            end += len(CLOSE)
            self._calls += self.parser.parse_block(tail[:end])
            rest = ToolCallStreamFilter(self.parser)
            shown = rest.push(tail[end:])
            more, calls = rest.finish()
            self._calls += calls
            return shown + more, list(self._calls)
        error = f"unterminated {OPEN} block: the output ended before {CLOSE}"
        self._calls.append(self.parser.malformed(tail, error))
        return "", list(self._calls)

    def take_calls(self) -> list[ToolCall]:
        """Calls completed since the last take."""
        new = self._calls[self._num_taken :]
        self._num_taken = len(self._calls)
        return new

    def _advance(self, shown: list[str]) -> bool:
        """Consume what the pending text decides; False when it needs more text."""
        if self._in_block:
            end = self._scan.find_close(self._pending)
            if end < 0:
                return False
            end += len(CLOSE)
            self._calls += self.parser.parse_block(self._pending[:end])
            self._pending, self._in_block = self._pending[end:], False
            return True
        start = self._pending.find(OPEN)
        if start < 0:
            cut = len(self._pending) - _partial_open_size(self._pending)
            shown.append(self._pending[:cut])
            self._pending = self._pending[cut:]
            return False
        shown.append(self._pending[:start])
        self._pending, self._in_block = self._pending[start:], True
        self._scan = _JsonScan(len(OPEN))
        return True


class _JsonScan:
    """Where an open block's text has been scanned to, and whether that point is inside a JSON
    string (double quotes, backslash escapes)."""

    __slots__ = ("escaped", "in_string", "position")

    def __init__(self, position: int = 0) -> None:
        self.position = position
        self.in_string = False
        self.escaped = False

    def find_close(self, text: str) -> int:
        """Index of the first CLOSE outside a string, or -1 (scanning resumes where it ended,
        short of a possible CLOSE still arriving)."""
        k = self.position
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
            elif ch == "<" and text.startswith(CLOSE, k):
                self.position = k
                return k
            elif ch == "<" and CLOSE.startswith(text[k:]):
                break  # may be a CLOSE still arriving
            k += 1
        self.position = k
        return -1


def _partial_open_size(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:size]):
            return size
    return 0
