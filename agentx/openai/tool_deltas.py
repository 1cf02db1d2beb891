"""Tool calls streamed as OpenAI streams them: a header delta, then argument fragments.

A pure accumulator over one choice's raw output text. Inside a ``<tool_call>`` block, each
entry the grammar writes as ``{"name": "fn", "arguments": {...}}`` becomes::

    (k, id, "fn", "")              once the name and the "arguments" key are complete
    (k, None, None, '{"a": 1')     the argument text as it arrives (JSON strings tracked, so a
    (k, None, None, ', "b": 2}')   brace inside a string does not end it)

The fragments of call ``k`` joined are its arguments' JSON text as the model wrote it. Output
that does not have this shape (no grammar, another order of keys) yields nothing here: the
caller sends such a call whole once its block parsed (:meth:`ToolCallDeltas.is_streamed`).
It does not know the ``openai`` types or the engine.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from agentx.session.tool_calls import CLOSE, OPEN

__all__ = ["CallDelta", "ToolCallDeltas"]

_ENTRY = re.compile(
    r'\s*(?:\[|\}\s*,)?\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*'
)


@dataclass(frozen=True, slots=True)
class CallDelta:
    index: int  # among the choice's calls
    id: str | None  # set on a call's first delta only
    name: str | None
    arguments: str


class ToolCallDeltas:
    """Push raw output text, get the call deltas it completes."""

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0
        self._in_block = False
        self._in_args = False
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._num_calls = 0
        self._done: list[bool] = []  # per streamed call: its arguments ended

    def push(self, text: str) -> list[CallDelta]:
        self._text += text
        deltas: list[CallDelta] = []
        while self._advance(deltas):
            pass
        return deltas

    def is_streamed(self, index: int) -> bool:
        """Whether call ``index`` was sent whole as deltas (its arguments ended)."""
        return index < len(self._done) and self._done[index]

    def is_started(self, index: int) -> bool:
        return index < len(self._done)

    def _advance(self, deltas: list[CallDelta]) -> bool:
        """Consume what the text decides; False when it needs more text."""
        if self._in_args:
            return self._scan_arguments(deltas)
        if not self._in_block:
            start = self._text.find(OPEN, self._pos)
            if start < 0:
                return False
            self._pos, self._in_block = start + len(OPEN), True
            return True
        entry = _ENTRY.match(self._text, self._pos)
        if entry is not None:
            call_id = f"call_{secrets.token_hex(12)}"
            deltas.append(CallDelta(self._num_calls, call_id, _unescape(entry.group(1)), ""))
            self._num_calls += 1
            self._done.append(False)
            self._pos, self._in_args, self._depth = entry.end(), True, 0
            return True
        end = self._text.find(CLOSE, self._pos)
        if end >= 0:
            self._pos, self._in_block = end + len(CLOSE), False
            return True
        return False

    def _scan_arguments(self, deltas: list[CallDelta]) -> bool:
        text, k = self._text, self._pos
        if self._depth == 0:
            while k < len(text) and text[k].isspace():
                k += 1
            self._pos = k
        if self._depth == 0 and k < len(text) and text[k] not in "{[":
            self._in_args = False  # not an object: the parsed call is sent whole instead
            return True
        ended = False
        while k < len(text) and not ended:
            ch = text[k]
            k += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                ended = self._depth == 0
        if k > self._pos:
            deltas.append(CallDelta(self._num_calls - 1, None, None, text[self._pos : k]))
        self._pos = k
        if ended:
            self._in_args = False
            self._done[-1] = True
            return True
        return False


def _unescape(name: str) -> str:
    return name.encode().decode("unicode_escape") if "\\" in name else name
