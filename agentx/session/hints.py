"""Hints: what an agent knows about the future, passed to the runtime with the next request.

Each hint is a small frozen record (defined in agentx.engine.hints, re-exported here). The
engine acts on each: priority orders the queue; a pin keeps the session's KV from being released
for room, in every tier; release drops it on close, everywhere; a tool latency lets the offload
tiers demote the waiting session and prefetch it back before the tool returns; a branch point
keeps the turn's KV for its forks (give it before the turn whose end you fork at); turns left
orders which session's KV is released first under pressure (fewest first).
"""

from __future__ import annotations

from agentx.engine.hints import (
    BranchPoint,
    Hint,
    Pin,
    Priority,
    Release,
    ToolLatency,
    TurnsLeft,
)
from agentx.errors import InvalidRequestError

__all__ = [
    "BranchPoint",
    "Hint",
    "Pin",
    "Priority",
    "Release",
    "ToolLatency",
    "TurnsLeft",
    "make_hints",
]

_KEYWORDS = {
    "tool_latency": ToolLatency,
    "branch": BranchPoint,
    "turns_left": TurnsLeft,
    "priority": Priority,
    "pin": Pin,
    "release": Release,
}


def make_hints(hints: tuple[Hint, ...], keywords: dict[str, object]) -> list[Hint]:
    """Hint records from positional records and keyword shorthands (``tool_latency=8.0``)."""
    out = list(hints)
    for name, value in keywords.items():
        if name not in _KEYWORDS:
            raise InvalidRequestError(f"unknown hint {name!r}; known: {sorted(_KEYWORDS)}")
        out.append(_KEYWORDS[name](value))
    for hint in out:
        if not isinstance(hint, Hint):
            raise InvalidRequestError(f"not a hint: {hint!r}")
    return out
