"""Held KV: a finished turn's KV kept whole for the next turn.

The words, from the Session down to this module: a request submitted with ``hold_kv=True``
leaves its KV *held* when it finishes, under a handle (its request id); a later request passes
that handle as ``held_kv`` to continue from it, and adopts the blocks when it runs. Held KV is
forked (``fork_held``), pinned (``pin_held``) and released (``release_held``) by its handle.
"Retention" is a different thing: the policy choosing which block boundaries a linear-attention
state is checkpointed at (``retention.py``).

The prefix cache shares full blocks only; the last, partial block of a turn would be recomputed
by the next one. Held KV keeps every block of a finished turn (partial tail included), so the
next turn of the same conversation resumes exactly where the last one stopped. Forking copies
only the partial tail block (copy-on-write); full blocks are shared by reference. Unpinned held
KV is a cache, not a reservation: under memory pressure it is released (in the KV policy's
order; by default the session expected back last, then the one with the fewest turns left
(a ``TurnsLeft`` hint), then the oldest, first) and the next turn falls back to the prefix cache.

A branch point (a turn carrying ``BranchPoint(n)``) holds its KV for the fan-out: it is not
released for room until ``n`` forks of it were made, and each fork made while it waited is not
released until a request adopts it (the fork's first turn starts). Then both are plain held KV
again. A fan-out under pressure therefore never recomputes the context its forks share::

    BranchPoint(3) turn ends -> held "p", forks_left=3      (pinned for the branch)
    fork_held("p", [a, b])   -> forks_left=1; a, b pending  (pinned until adopted)
    fork_held("p", [c])      -> forks_left=0; c pending     ("p" releasable again)
    a's first turn adopts a  -> a gone (its blocks moved into the request)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from agentx.engine.kv_cache.block_pool import BlockPool, KVBlock
from agentx.engine.kv_cache.coordinator import GroupBlocks
from agentx.engine.kv_cache.policy import HeldCandidate, default_eviction_order
from agentx.engine.kv_cache.policy_guard import KVPolicyGuard
from agentx.engine.outputs import BlockCopy


@dataclass(slots=True, eq=False)
class HeldKV:
    handle: str
    token_ids: list[int]  # the tokens whose KV the blocks hold, in order
    blocks: GroupBlocks  # per KV group: ceil(len(token_ids) / block_size) blocks
    pinned: bool = False  # a Pin hint: never released for room
    last_used: int = 0
    forks_left: int = 0  # a branch point waiting for this many more forks: not released
    fork_pending: bool = False  # a fork of a waiting branch point, not adopted yet: not released
    turns_left: int | None = None  # the session's last TurnsLeft hint (None: not hinted)
    cache_salt: bytes = b""  # the salt of the request that wrote it: only that salt extends it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_protected(self) -> bool:
        """Not a candidate for release under pressure (pinned, or held for a branch)."""
        return self.pinned or self.forks_left > 0 or self.fork_pending


class HeldKVManager:
    """Handles -> held KV, drawing on the shared pool. Callers hold the engine step."""

    def __init__(
        self, pool: BlockPool, block_size: int, policy: KVPolicyGuard | None = None
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.policy = policy  # orders reclaim (None: the built-in order)
        self._held: dict[str, HeldKV] = {}
        self._clock = 0
        # handle -> when its session is expected back (a tool latency hint): under pressure,
        # the held KV expected back last is released first (its blocks live on in the tiers)
        self.expected_return: dict[str, float] = {}
        # called with held KV about to be released (the KV manager keeps its tail as a
        # partial-hit source)
        self.on_release: Callable[[HeldKV], None] | None = None

    def __contains__(self, handle: str) -> bool:
        return handle in self._held

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[HeldKV]:
        return iter(self._held.values())

    def get(self, handle: str | None) -> HeldKV | None:
        return self._held.get(handle) if handle is not None else None

    def add(
        self,
        handle: str,
        token_ids: list[int],
        blocks: GroupBlocks,
        cache_salt: bytes = b"",
        *,
        num_forks: int = 0,
        turns_left: int | None = None,
    ) -> HeldKV:
        """Take over ``blocks`` (their references move in) for ``token_ids``, written under
        ``cache_salt``. ``num_forks``: a branch point, held until that many forks were made.
        ``turns_left``: the session's turns-left hint (orders release under pressure)."""
        self.release(handle)
        num_blocks = -(-len(token_ids) // self.block_size)
        excess = [b for group in blocks for b in reversed(group[num_blocks:])]
        self.pool.free_blocks(excess)
        kept = tuple(group[:num_blocks] for group in blocks)
        self._clock += 1
        held = HeldKV(handle, list(token_ids), kept, last_used=self._clock, cache_salt=cache_salt)
        held.forks_left = num_forks
        held.turns_left = turns_left
        self._held[handle] = held
        return held

    def release(self, handle: str, drop_cached: bool = False) -> bool:
        self.expected_return.pop(handle, None)
        held = self._held.pop(handle, None)
        if held is None:
            return False
        if self.on_release is not None and not drop_cached:
            self.on_release(held)  # before its blocks go back: a tail it alone holds
        blocks = [b for group in held.blocks for b in reversed(group)]
        self.pool.free_blocks(blocks)
        if drop_cached:
            self.pool.drop_cached(blocks)
        return True

    def set_pinned(self, handle: str, pinned: bool) -> bool:
        held = self._held.get(handle)
        if held is None:
            return False
        held.pinned = pinned
        return True

    def fork(self, handle: str, new_handles: list[str]) -> list[BlockCopy] | None:
        """Give each new handle the same held KV; None (nothing changed) if the pool is short.

        Full blocks are shared by reference; a partial tail block gets a private copy per
        child, since each child will append different tokens into it. Forks of a branch point
        still waiting for forks count against it and are held until adopted.
        """
        src = self._held[handle]
        partial = src.num_tokens % self.block_size != 0
        num_copies = len(new_handles) * len(src.blocks) if partial else 0
        if num_copies > self.pool.num_free_blocks:
            return None
        copies: list[BlockCopy] = []
        for new in new_handles:
            blocks = []
            for group in src.blocks:
                shared = group[:-1] if partial else group
                self.pool.touch(shared)
                tail: list[KVBlock] = []
                if partial:
                    tail = self.pool.allocate_blocks(1)
                    copies.append(BlockCopy(group[-1].block_id, tail[0].block_id))
                blocks.append(list(shared) + tail)
            child = self.add(new, src.token_ids, tuple(blocks), src.cache_salt)
            child.fork_pending = src.forks_left > 0
        src.forks_left = max(0, src.forks_left - len(new_handles))
        return copies

    def get_candidates(self, keep: str | None = None) -> list[HeldCandidate]:
        """Unprotected held KV but ``keep``, as the KV policy sees it (no side effects)."""
        return [
            HeldCandidate(
                h.handle,
                h.num_tokens,
                sum(1 for g in h.blocks for b in g if not b.is_null),
                h.last_used,
                self.expected_return.get(h.handle),
                h.turns_left,
            )
            for h in self._held.values()
            if not h.is_protected and h.handle != keep
        ]

    def reclaim(self, num_blocks: int, keep: str | None = None) -> None:
        """Release unpinned held KV, in the policy's order, until ``num_blocks`` are free (or
        none is left to release). ``keep`` is spared: a request is adopting it. The order is
        chosen (and validated) before anything is released."""
        if self.pool.num_free_blocks >= num_blocks:
            return
        candidates = self.get_candidates(keep)
        if not candidates:
            return
        deficit = num_blocks - self.pool.num_free_blocks
        if self.policy is not None:
            order = self.policy.choose_evictions(candidates, deficit)
        else:
            order = default_eviction_order(candidates)
        for handle in order:
            if self.pool.num_free_blocks >= num_blocks:
                return
            self.release(handle)

    def check_integrity(self) -> None:
        for held in self._held.values():
            assert held.forks_left >= 0, f"{held.handle}: forks_left {held.forks_left}"
            assert held.turns_left is None or held.turns_left >= 0, f"{held.handle}: turns_left"

    def iter_blocks(self) -> Iterator[KVBlock]:
        for held in self._held.values():
            for group in held.blocks:
                yield from group
