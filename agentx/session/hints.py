"""Hints: what an agent knows about the future, passed to the runtime with the next request.

Each hint is a small frozen record. The engine acts on some now (priority orders the queue; a
pin keeps the session's KV from being released for room; release drops it on close) and carries
the rest (tool latency, branch points, turns left) on the request for the offload tiers.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentx.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class ToolLatency:
    """The tool call now running will take about ``seconds``."""

    seconds: float


@dataclass(frozen=True, slots=True)
class BranchPoint:
    """This prefix will be forked ``num_forks`` times."""

    num_forks: int


@dataclass(frozen=True, slots=True)
class TurnsLeft:
    """About ``num_turns`` more turns will follow in this session."""

    num_turns: int


@dataclass(frozen=True, slots=True)
class Priority:
    """Lower runs first (the engine's priority queue); 0 is the default."""

    level: int


@dataclass(frozen=True, slots=True)
class Pin:
    """Keep (``pinned=True``) or stop keeping this session's KV from being released for room."""

    pinned: bool = True


@dataclass(frozen=True, slots=True)
class Release:
    """On close, drop this session's cached blocks too, not only its hold on them."""

    drop_cached: bool = True


Hint = ToolLatency | BranchPoint | TurnsLeft | Priority | Pin | Release

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
