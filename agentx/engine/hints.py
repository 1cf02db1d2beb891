"""Hint records: what an agent knows about the future, carried on a request.

The session builds them (agentx.session.hints re-exports these records); the engine acts on
four of them: priority orders the queue, pin and release act on held KV, and the offload manager
uses the tool latency to demote a waiting session's blocks and prefetch them before it returns.
``BranchPoint`` and ``TurnsLeft`` are advisory: they travel with the request (a backend or a
policy may read them) but nothing in this engine acts on them yet.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolLatency:
    """The tool call now running will take about ``seconds``."""

    seconds: float


@dataclass(frozen=True, slots=True)
class BranchPoint:
    """This prefix will be forked ``num_forks`` times. Advisory: nothing acts on it yet."""

    num_forks: int


@dataclass(frozen=True, slots=True)
class TurnsLeft:
    """About ``num_turns`` more turns will follow in this session. Advisory: nothing acts on
    it yet."""

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

__all__ = ["BranchPoint", "Hint", "Pin", "Priority", "Release", "ToolLatency", "TurnsLeft"]
