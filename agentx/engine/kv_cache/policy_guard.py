"""The policy guard: the one boundary between a user's KV policy and the cache.

Every hook call goes through :class:`KVPolicyGuard`. It catches what the policy raises, checks
the answer's type and range against what the caller can apply (block counts within the turn,
handles among the candidates, finite times), and only then hands it on; so a policy error is
found before the cache changes, never halfway through applying a decision. On an error the
guard either raises :class:`~agentx.errors.KVPolicyError` ("raise") or logs it, keeps it for
``take_errors`` and answers with the built-in decision ("fallback"). It knows the hooks'
records, not blocks or requests' internals.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from agentx.engine.hints import MAX_TOOL_LATENCY_S
from agentx.engine.kv_cache.policy import (
    CheckpointPlan,
    HeldCandidate,
    KVPolicy,
    ToolWait,
    ToolWaitDecision,
    TurnEnd,
    TurnEndDecision,
    default_eviction_order,
)
from agentx.engine.request import Request
from agentx.errors import KVPolicyError

logger = logging.getLogger("agentx.engine")

T = TypeVar("T")
ERROR_MODES = ("fallback", "raise")
_DEFAULTS = KVPolicy  # the base class's hooks are the built-in decisions


class _Invalid(Exception):
    """An answer that breaks the hook's contract (the message says how)."""


class KVPolicyGuard:
    """Calls ``policy``'s hooks and validates their answers; ``retention`` plans checkpoints
    when the policy defers (returns None) or fails. Engine loop thread only."""

    def __init__(self, policy: KVPolicy, retention: KVPolicy, errors: str = "fallback") -> None:
        if errors not in ERROR_MODES:
            raise ValueError(f"errors must be one of {ERROR_MODES}, got {errors!r}")
        self.policy = policy
        self.retention = retention
        self.errors = errors
        self.num_errors = 0
        self._errors: list[KVPolicyError] = []

    @property
    def name(self) -> str:
        return str(getattr(self.policy, "name", "") or type(self.policy).__name__)

    def plan_checkpoints(self, request: Request, block_size: int) -> CheckpointPlan:
        def check(plan: object) -> CheckpointPlan:
            if plan is None:
                plan = self.retention.plan_checkpoints(request, block_size)
            return _check_plan(plan, block_size)

        return self._call(
            "plan_checkpoints",
            lambda: self.policy.plan_checkpoints(request, block_size),
            check,
            lambda: self.retention.plan_checkpoints(request, block_size),
        )

    def on_turn_end(self, turn: TurnEnd) -> TurnEndDecision:
        return self._call(
            "on_turn_end",
            lambda: self.policy.on_turn_end(turn),
            lambda d: _check_turn_end(d, turn),
            lambda: _DEFAULTS.on_turn_end(self.policy, turn),
        )

    def choose_evictions(self, candidates: Sequence[HeldCandidate], num_blocks: int) -> list[str]:
        """The policy's order, then the candidates it did not name in the default order."""
        chosen = self._call(
            "choose_evictions",
            lambda: self.policy.choose_evictions(tuple(candidates), num_blocks),
            lambda d: _check_evictions(d, candidates),
            lambda: [],
        )
        named = set(chosen)
        return chosen + default_eviction_order([c for c in candidates if c.handle not in named])

    def on_tool_wait(self, wait: ToolWait) -> ToolWaitDecision:
        return self._call(
            "on_tool_wait",
            lambda: self.policy.on_tool_wait(wait),
            _check_tool_wait,
            lambda: _DEFAULTS.on_tool_wait(self.policy, wait),
        )

    def take_errors(self) -> list[KVPolicyError]:
        """Drain the errors fallen back from since the last call."""
        out, self._errors = self._errors, []
        return out

    def _call(
        self,
        hook: str,
        ask: Callable[[], object],
        check: Callable[[object], T],
        fallback: Callable[[], T],
    ) -> T:
        try:
            answer = ask()
        except Exception as exc:  # a policy bug must not reach the cache, or kill the loop
            error = KVPolicyError(
                f"KV policy {self.name!r}: {hook} raised {type(exc).__name__}: {exc}",
                self.name,
                hook,
            )
            return self._fail(error, exc, fallback)
        try:
            return check(answer)
        except _Invalid as exc:
            error = KVPolicyError(f"KV policy {self.name!r}: {hook} {exc}", self.name, hook)
            return self._fail(error, None, fallback)

    def _fail(self, error: KVPolicyError, cause: Exception | None, fallback: Callable[[], T]) -> T:
        error.__cause__ = cause
        self.num_errors += 1
        if self.errors == "raise":
            raise error
        logger.warning("%s; using the built-in decision", error)
        self._errors.append(error)
        return fallback()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_plan(plan: object, block_size: int) -> CheckpointPlan:
    if not isinstance(plan, CheckpointPlan):
        raise _Invalid(f"returned {plan!r}, expected a CheckpointPlan or None")
    bad = [b for b in plan.fixed if not _is_int(b) or b <= 0 or b % block_size]
    if not isinstance(plan.fixed, frozenset) or bad:
        raise _Invalid(
            f"returned fixed={plan.fixed!r}: boundaries must be a frozenset of positive "
            f"multiples of the block size {block_size}"
        )
    if not _is_int(plan.every) or plan.every < 0 or plan.every % block_size:
        raise _Invalid(
            f"returned every={plan.every!r}: must be 0 or a multiple of the block size {block_size}"
        )
    if not isinstance(plan.rolling, bool):
        raise _Invalid(f"returned rolling={plan.rolling!r}, expected a bool")
    return plan


def _check_turn_end(decision: object, turn: TurnEnd) -> TurnEndDecision:
    if not isinstance(decision, TurnEndDecision):
        raise _Invalid(f"returned {decision!r}, expected a TurnEndDecision")
    n = decision.soft_pin_blocks
    if not _is_int(n) or not 0 <= n <= turn.num_full_blocks:
        raise _Invalid(
            f"returned soft_pin_blocks={n!r}: the turn has {turn.num_full_blocks} full blocks"
        )
    if not isinstance(decision.demote, bool):
        raise _Invalid(f"returned demote={decision.demote!r}, expected a bool")
    return decision


def _check_evictions(handles: object, candidates: Sequence[HeldCandidate]) -> list[str]:
    if not isinstance(handles, list | tuple):
        raise _Invalid(f"returned {handles!r}, expected a list of candidate handles")
    known = {c.handle for c in candidates}
    unknown = [h for h in handles if not isinstance(h, str) or h not in known]
    if unknown:
        raise _Invalid(f"returned {unknown[:5]!r}: not among the candidates {sorted(known)[:5]}")
    if len(set(handles)) != len(handles):
        raise _Invalid(f"returned a handle twice: {list(handles)!r}")
    return list(handles)


def _check_tool_wait(decision: object) -> ToolWaitDecision:
    if not isinstance(decision, ToolWaitDecision):
        raise _Invalid(f"returned {decision!r}, expected a ToolWaitDecision")
    if not isinstance(decision.demote, bool):
        raise _Invalid(f"returned demote={decision.demote!r}, expected a bool")
    t = decision.prefetch_in_s
    if t is not None and (
        isinstance(t, bool)
        or not isinstance(t, int | float)
        or not (math.isfinite(t) and 0 <= t <= MAX_TOOL_LATENCY_S)
    ):
        raise _Invalid(
            f"returned prefetch_in_s={t!r}: expected None or seconds in [0, {MAX_TOOL_LATENCY_S:g}]"
        )
    return decision


__all__ = ["ERROR_MODES", "KVPolicyGuard"]
