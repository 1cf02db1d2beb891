"""The typed events a streaming turn yields, each tagged by ``type``.

A turn streams ``TextDelta``s for plain text only (tool-call markup is held back), one
``ToolCallEvent`` per call once its block is complete (malformed calls too, with ``call.error``
set), and ends with exactly one ``TurnDone`` carrying the whole assistant message. Events are
frozen slotted records: one is allocated per decoded chunk, so they stay small. This file does not
know how they are produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from agentx.session.messages import AssistantMessage, ToolCall, Usage

__all__ = ["TextDelta", "ToolCallEvent", "TurnDone", "TurnEvent"]


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New plain text since the previous event."""

    type: Literal["text.delta"] = field(default="text.delta", init=False)
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallEvent:
    """A complete tool call; ``call.ok`` is false when the model's markup was malformed."""

    type: Literal["tool_call"] = field(default="tool_call", init=False)
    call: ToolCall


@dataclass(frozen=True, slots=True)
class TurnDone:
    """The last event of a turn: the assistant message as it enters the history."""

    type: Literal["turn.done"] = field(default="turn.done", init=False)
    message: AssistantMessage
    usage: Usage


TurnEvent = TextDelta | ToolCallEvent | TurnDone
