"""Hint records: what an agent knows about the future, carried on a request.

The session builds them (agentx.session.hints re-exports these records); the engine acts on
every one: priority orders the queue, pin and release act on held KV, the offload manager uses
the tool latency to demote a waiting session's blocks and prefetch them before it returns (and
a router may move the session to another replica meanwhile), a branch point's held KV is kept
until its forks were made (and each fork until it starts), and held KV of sessions with fewer
turns left is released first under pressure (kv_cache/held.py). A KV policy gets every hint of
a finished turn in ``TurnEnd.hints``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agentx.errors import InvalidRequestError

# A tool latency past a day is not a plan the tiers can act on; rejecting it keeps a typo
# (or inf) from parking a prefetch forever.
MAX_TOOL_LATENCY_S = 86_400.0


def _check_int(owner: str, field: str, value: object, minimum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{owner}.{field} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise InvalidRequestError(f"{owner}.{field} must be >= {minimum}, got {value}")


def _check_bool(owner: str, field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{owner}.{field} must be a bool, got {value!r}")


@dataclass(frozen=True, slots=True)
class ToolLatency:
    """The tool call now running will take about ``seconds``."""

    seconds: float

    def __post_init__(self) -> None:
        value = self.seconds
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequestError(f"ToolLatency.seconds must be a number, got {value!r}")
        if not (math.isfinite(value) and 0.0 <= value <= MAX_TOOL_LATENCY_S):
            raise InvalidRequestError(
                f"ToolLatency.seconds must be finite, in [0, {MAX_TOOL_LATENCY_S:g}], got {value}"
            )


@dataclass(frozen=True, slots=True)
class BranchPoint:
    """The KV this turn leaves will be forked ``num_forks`` times: it is held against memory
    pressure until that many forks were made, and each fork until its first turn starts."""

    num_forks: int

    def __post_init__(self) -> None:
        _check_int("BranchPoint", "num_forks", self.num_forks, minimum=1)


@dataclass(frozen=True, slots=True)
class TurnsLeft:
    """About ``num_turns`` more turns will follow this one in the session (0: this is the last).
    Under pressure, held KV of sessions with fewer turns left is released first."""

    num_turns: int

    def __post_init__(self) -> None:
        _check_int("TurnsLeft", "num_turns", self.num_turns, minimum=0)


@dataclass(frozen=True, slots=True)
class Priority:
    """Lower runs first (the engine's priority queue); 0 is the default."""

    level: int

    def __post_init__(self) -> None:
        _check_int("Priority", "level", self.level)


@dataclass(frozen=True, slots=True)
class Pin:
    """Keep (``pinned=True``) or stop keeping this session's KV from being released for room."""

    pinned: bool = True

    def __post_init__(self) -> None:
        _check_bool("Pin", "pinned", self.pinned)


@dataclass(frozen=True, slots=True)
class Release:
    """On close, drop this session's cached blocks too, not only its hold on them."""

    drop_cached: bool = True

    def __post_init__(self) -> None:
        _check_bool("Release", "drop_cached", self.drop_cached)


Hint = ToolLatency | BranchPoint | TurnsLeft | Priority | Pin | Release
HINT_TYPES = (ToolLatency, BranchPoint, TurnsLeft, Priority, Pin, Release)

__all__ = ["BranchPoint", "Hint", "Pin", "Priority", "Release", "ToolLatency", "TurnsLeft"]
