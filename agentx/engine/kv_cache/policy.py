"""KV policies: the user-programmable decisions of the KV cache, in Python.

A :class:`KVPolicy` is asked at five points and answers with a small frozen record; the engine
validates the answer (``policy_guard.py``) and then applies it itself, so a policy never
touches a block, a reference count or a queue::

    hook                 asked when                                answers
    plan_checkpoints     a request is first given blocks           CheckpointPlan | None
                         (retention points of a linear state)      (None: the configured
                                                                   retention decides)
    on_turn_end          a turn finished (held or not)             TurnEndDecision
                                                                   (soft-pin / demote)
    choose_evictions     held KV must be released to make room     handles, release-first order
    on_tool_wait         a finished turn's session waits on a      ToolWaitDecision
                         tool with a latency hint (offload tiers)  (demote / prefetch time)

Every hook has a default equal to the built-in behaviour, so a policy overrides only what it
means to change: least recently used release of held KV (the session expected back last goes
first; among equals, the session with the fewest turns left), nothing soft-pinned or demoted
at turn end, demote on a tool wait and prefetch
``prefetch_margin_s`` before the tool returns. The retention built-ins (``IntervalRetention``,
``MarconiRetention``, ``NoRetention`` in ``retention.py``) are KV policies that override
``plan_checkpoints``. Block-level eviction stays the pool's O(1) LRU queue: a policy orders it
through turn-end decisions (a demoted block is reused first, a soft-pinned one last), not by a
Python call per allocated block.

Hooks run on the engine loop thread, inside the step: they must be quick and must not call the
engine. The records they get are copies; mutating them changes nothing.
"""

from __future__ import annotations

import math
from abc import ABC
from collections.abc import Sequence
from dataclasses import dataclass

from agentx.engine.block_hash import BlockHash
from agentx.engine.hints import Hint
from agentx.engine.request import Request


@dataclass(frozen=True, slots=True)
class CheckpointPlan:
    """The boundaries (token counts, multiples of the block size) to checkpoint for a request."""

    fixed: frozenset[int] = frozenset()
    every: int = 0  # also every multiple of this many tokens (0: none)
    rolling: bool = False  # also the latest boundary reached, replacing the previous one

    def keeps(self, boundary: int) -> bool:
        return boundary in self.fixed or (self.every > 0 and boundary % self.every == 0)


@dataclass(frozen=True, slots=True)
class TurnEnd:
    """A turn that just finished: its KV is about to be held (``held``) or freed to the cache."""

    request_id: str
    num_tokens: int  # computed tokens: the KV the turn leaves
    num_prompt_tokens: int
    num_full_blocks: int  # blocks a later prefix hit can use (the first num_tokens // block_size)
    block_size: int
    block_hashes: tuple[BlockHash, ...]  # of the full blocks
    held: bool
    hints: tuple[Hint, ...]


@dataclass(frozen=True, slots=True)
class TurnEndDecision:
    """``soft_pin_blocks``: the turn's first N full blocks are evicted last (after every other
    free cached block; a soft pin ends when the block is finally evicted). ``demote``: the turn's
    other cached blocks are reused first; a held turn is released to the prefix cache (its
    partial tail is recomputed by the next turn; the offload tiers keep what they stored)."""

    soft_pin_blocks: int = 0
    demote: bool = False


@dataclass(frozen=True, slots=True)
class HeldCandidate:
    """Unpinned held KV that may be released to make room (``Pin`` holds KV for real)."""

    handle: str
    num_tokens: int
    num_blocks: int  # pool blocks it references, every group
    last_used: int  # a tick, larger: held more recently
    expected_return: float | None  # when a tool-latency hint expects its session back
    turns_left: int | None = None  # its session's TurnsLeft hint (None: not hinted)


@dataclass(frozen=True, slots=True)
class ToolWait:
    """A finished turn whose session now waits ``seconds`` on a tool."""

    request_id: str
    seconds: float
    num_tokens: int
    num_full_blocks: int
    held: bool
    prefetch_margin_s: float  # OffloadConfig.prefetch_margin_s


@dataclass(frozen=True, slots=True)
class ToolWaitDecision:
    """``demote``: the turn's device blocks are released first under pressure (the tiers keep
    them). ``prefetch_in_s``: load them back this many seconds from now (None: never)."""

    demote: bool = True
    prefetch_in_s: float | None = 0.0


class KVPolicy(ABC):  # noqa: B024 (every hook has a default: override what you change)
    """What to keep, demote, prefetch and soft-pin, and where to checkpoint.

    Contract for every hook: it is called on the engine loop thread with no lock the policy
    must take; it reads only its arguments and its own state; it returns the documented record
    (anything else, or an exception, is a policy error: see ``CacheConfig.kv_policy_errors``).
    A hook never mutates the cache; the engine applies the validated answer afterwards.
    """

    name: str = ""  # in errors and logs ("": the class name)

    def plan_checkpoints(self, request: Request, block_size: int) -> CheckpointPlan | None:
        """Retention points of a request on a layout with a linear state (called once, when the
        request is first given blocks; ``request`` is read-only to the policy). None: the
        configured ``CacheConfig.retention_policy`` decides."""
        return None

    def on_turn_end(self, turn: TurnEnd) -> TurnEndDecision:
        """Called before a finished turn's KV is held or freed. Default: keep as it is."""
        return TurnEndDecision()

    def choose_evictions(self, candidates: Sequence[HeldCandidate], num_blocks: int) -> list[str]:
        """Order in which held KV is released while ``num_blocks`` more pool blocks are needed.

        Return handles of ``candidates``; the named ones are released first, in that order;
        those not named follow in the default order only if still short (a policy cannot
        starve the pool). Default: the session expected back last first, then the session with
        the fewest turns left (``TurnsLeft``; not hinted counts as more than any), then least
        recently used first. Held KV pinned (``Pin``) or held for a branch (``BranchPoint``,
        see held.py) is never a candidate.
        """
        return default_eviction_order(candidates)

    def on_tool_wait(self, wait: ToolWait) -> ToolWaitDecision:
        """Called after the step that finished the turn (offload tiers only). Default: demote,
        prefetch ``prefetch_margin_s`` before the tool returns."""
        return ToolWaitDecision(True, max(0.0, wait.seconds - wait.prefetch_margin_s))


def default_eviction_order(candidates: Sequence[HeldCandidate]) -> list[str]:
    """The built-in release order: expected back last first, then fewest turns left (a session
    about to end needs its KV least; TurnsLeft(0): it just had its last turn), then least
    recently used."""

    def key(c: HeldCandidate) -> tuple[float, float, int]:
        turns = math.inf if c.turns_left is None else c.turns_left
        return (-(c.expected_return or 0.0), turns, c.last_used)

    return [c.handle for c in sorted(candidates, key=key)]


class LRUPolicy(KVPolicy):
    """The built-in behaviour, named: every hook at its default."""

    name = "lru"


__all__ = [
    "CheckpointPlan",
    "HeldCandidate",
    "KVPolicy",
    "LRUPolicy",
    "ToolWait",
    "ToolWaitDecision",
    "TurnEnd",
    "TurnEndDecision",
    "default_eviction_order",
]
