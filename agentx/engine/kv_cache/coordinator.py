"""The coordinator: one prefix-hit length, one allocation and one free across all KV groups.

Every group draws from the same pool. A prefix hit must hold in every group, and groups differ
in which lengths they can resume from: full attention any prefix of its cached blocks, sliding
window a length whose last window is cached, linear state only a length with a checkpoint
exactly there. The hit length is narrowed group by group until all agree; lengths only shrink,
so this ends.

With offload tiers the same rule runs over two sources: a group's block at entry i is usable
when the device caches it or a tier holds it (``plan_tier_hit``). The agreed length is the
longest one every group can resume from; what the device lacks of it is loaded::

    entries      0    1    2    3    4    5        hit of 6 blocks
    full         dev  dev  tier tier tier dev      every entry
    sliding      -    -    -    -    tier dev      the last window (2 blocks here)
    linear       -    -    -    -    -    tier     the checkpoint at the hit point
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agentx.engine.block_hash import BlockHash
from agentx.engine.kv_cache.block_pool import BlockPool, KVBlock
from agentx.engine.kv_cache.linear_state import LinearStateManager  # registers its spec
from agentx.engine.kv_cache.policy_guard import KVPolicyGuard
from agentx.engine.kv_cache.retention import RetentionPolicy
from agentx.engine.kv_cache.single_type import (
    FullAttentionManager,
    SingleTypeKVManager,
    _num_revived,
    make_manager,
)
from agentx.engine.kv_cache.specs import KVCacheLayout
from agentx.engine.request import Request

GroupBlocks = tuple[list[KVBlock], ...]


@dataclass(frozen=True, slots=True)
class TierHit:
    """A prefix hit of ``num_blocks`` blocks that every group agrees on, device and tiers
    together: the device blocks it reuses and the pool keys of the blocks to load (entry
    order, so a load failing midway still leaves a usable prefix)."""

    num_blocks: int
    device_blocks: list[KVBlock]
    keys: list[BlockHash]
    # an exact hit (``plan_exact_hit``): the groups whose last entry is a tail page of its
    # own, in order; the last ``len(tail_groups)`` keys are those pages' keys
    tail_groups: tuple[int, ...] = ()


class KVCacheCoordinator:
    def __init__(
        self,
        layout: KVCacheLayout,
        enable_caching: bool,
        retention: KVPolicyGuard | RetentionPolicy | None = None,
    ) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.pool = BlockPool(layout.num_blocks, enable_caching)
        self.managers: tuple[SingleTypeKVManager, ...] = tuple(
            make_manager(g.spec, self.pool, i, retention) for i, g in enumerate(layout.groups)
        )
        self.has_linear = any(isinstance(m, LinearStateManager) for m in self.managers)
        # whether a partial hit can be taken: it copies the first tokens of one cached block,
        # so one full-attention group (a sliding window or a linear state needs more)
        self.partial_hits = (
            enable_caching
            and len(self.managers) == 1
            and isinstance(self.managers[0], FullAttentionManager)
        )

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[GroupBlocks, int]:
        hit_length = max_length - max_length % self.block_size
        while True:
            hits = [m.find_longest_cache_hit(block_hashes, hit_length) for m in self.managers]
            num_blocks = min(len(h) for h in hits)
            if num_blocks == 0:
                return tuple([] for _ in self.managers), 0
            hit_length = num_blocks * self.block_size
            if all(len(h) == num_blocks for h in hits):
                return tuple(hits), hit_length

    def plan_tier_hit(
        self,
        block_hashes: Sequence[BlockHash],
        in_tiers: Callable[[list[BlockHash]], list[bool]],
        num_free: int | None = None,
        use_device: bool = True,
    ) -> TierHit:
        """The longest hit of at most ``len(block_hashes)`` blocks that the device cache and
        the tiers (``in_tiers``: one presence flag per pool key, asked once) complete in every
        group, loading at most ``num_free`` fresh blocks (a revived free device block counts
        too). ``use_device=False``: from the tiers alone. No side effects."""
        keys = [[m.key(h) for h in block_hashes] for m in self.managers]
        device = [
            [self.pool.get_cached_block(k) if use_device else None for k in group] for group in keys
        ]
        missing = [k for g, ks in enumerate(keys) for i, k in enumerate(ks) if device[g][i] is None]
        present = {k for k, found in zip(missing, in_tiers(missing), strict=True) if found}
        for num_blocks in range(len(block_hashes), 0, -1):
            needed = sorted(
                (i, g)
                for g, m in enumerate(self.managers)
                for i in m.get_hit_block_indices(num_blocks)
            )
            if not all(device[g][i] is not None or keys[g][i] in present for i, g in needed):
                continue
            reused = [b for i, g in needed if (b := device[g][i]) is not None]
            load = [keys[g][i] for i, g in needed if device[g][i] is None]
            if num_free is not None and len(load) + _num_revived(reused) > num_free:
                continue
            return TierHit(num_blocks, reused, load)
        return TierHit(0, [], [])

    def plan_exact_hit(
        self,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        tail_key: BlockHash,
        in_tiers: Callable[[list[BlockHash]], list[bool]],
        num_free: int | None = None,
        use_device: bool = True,
    ) -> TierHit | None:
        """A hit of exactly ``num_tokens`` tokens (``block_hashes``: its full blocks), as a
        hand-over resumes: in every group the full blocks its next token reads and, where the
        group ends in a page of its own, that page, stored under the group's key of
        ``tail_key``. None when the device and the tiers lack any of it or its fresh blocks
        exceed ``num_free``. No side effects::

            entries      0    1    2    3    [tail]      num_tokens = 4 blocks + 3 tokens
            full         dev  tier tier tier  tail
            sliding      -    -    -    tier  tail       the next token's window only
            linear       -    -    -    -     tail       its running state after 19 tokens
        """
        needed, tails = self._get_exact_entries(num_tokens)
        keys = [self.managers[g].key(block_hashes[i]) for i, g in needed]
        device = [self.pool.get_cached_block(k) if use_device else None for k in keys]
        load = [k for k, b in zip(keys, device, strict=True) if b is None]
        load += [self.managers[g].key(tail_key) for g in tails]
        if not all(in_tiers(load)):
            return None
        reused = [b for b in device if b is not None]
        if num_free is not None and len(load) + _num_revived(reused) > num_free:
            return None
        return TierHit(num_tokens // self.block_size, reused, load, tails)

    def take_exact_hit(
        self, block_hashes: Sequence[BlockHash], num_tokens: int, tails: list[KVBlock]
    ) -> GroupBlocks | None:
        """The held blocks of an exact hit whose pages are on the device now: its full blocks
        from the device cache (referenced here), ``tails`` (their references move in) as the
        last entry of ``plan_exact_hit``'s tail groups. None, touching nothing, when a full
        block is not cached."""
        needed, tails_of = self._get_exact_entries(num_tokens)
        found = [self.managers[g].get_cached(block_hashes[i]) for i, g in needed]
        if any(b is None for b in found) or len(tails) != len(tails_of):
            return None
        num_entries = -(-num_tokens // self.block_size)
        groups = tuple([self.pool.null_block] * num_entries for _ in self.managers)
        for (i, g), block in zip(needed, found, strict=True):
            groups[g][i] = block
        self.pool.touch(found)
        for g, block in zip(tails_of, tails, strict=True):
            groups[g][-1] = block
        return groups

    def get_tail_blocks(self, groups: GroupBlocks, num_tokens: int) -> list[tuple[int, KVBlock]]:
        """(group, block) of the tail pages an exact hit of ``groups`` (KV of ``num_tokens``
        tokens, as held) needs besides its full blocks: each such group's last entry."""
        return [(g, groups[g][-1]) for g in self._get_exact_entries(num_tokens)[1]]

    def _get_exact_entries(self, num_tokens: int) -> tuple[list[tuple[int, int]], tuple[int, ...]]:
        """(entry, group) of the full blocks an exact hit reads, entry order; its tail groups."""
        entries = [m.get_exact_hit_entries(num_tokens) for m in self.managers]
        needed = sorted((i, g) for g, (full, _) in enumerate(entries) for i in full)
        return needed, tuple(g for g, (_, tail) in enumerate(entries) if tail)

    def get_num_blocks_to_allocate(
        self,
        request: Request,
        num_tokens: int,
        new_computed: GroupBlocks,
        keep_checkpoints: bool = True,
    ) -> int:
        return sum(
            m.get_num_blocks_to_allocate(request, num_tokens, new_computed[i], keep_checkpoints)
            for i, m in enumerate(self.managers)
        )

    def save_new_computed_blocks(self, request_id: str, new_computed: GroupBlocks) -> None:
        for i, m in enumerate(self.managers):
            m.save_new_computed_blocks(request_id, new_computed[i])

    def allocate_new_blocks(
        self, request: Request, num_tokens: int, keep_checkpoints: bool = True
    ) -> GroupBlocks:
        return tuple(
            m.allocate_new_blocks(request, num_tokens, keep_checkpoints) for m in self.managers
        )

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for m in self.managers:
            m.cache_blocks(request, num_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def uncache_uncomputed(self, request_id: str, num_computed_tokens: int) -> None:
        """Forget published blocks past the request's computed tokens (their KV never ran)."""
        first = num_computed_tokens // self.block_size
        for m in self.managers:
            blocks = m.req_to_blocks.get(request_id, [])[first:]
            self.pool.uncache_blocks([b for b in blocks if not b.is_null])

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Keep only the blocks of the request's first ``num_tokens`` tokens in every group;
        returns the blocks released (attention groups only: a linear state cannot roll back,
        so the engine never drafts for a layout that has one)."""
        assert not self.has_linear, "linear state cannot roll back rejected drafts"
        num_blocks = -(-num_tokens // self.block_size)
        return sum(m.trim(request_id, num_blocks) for m in self.managers)

    def take(self, request_id: str) -> GroupBlocks:
        return tuple(m.take(request_id) for m in self.managers)

    def free(self, request_id: str) -> None:
        """Free every group's blocks. In a hybrid with linear state, attention blocks past the
        deepest checkpoint can be part of no future hit, so they are reused first."""
        useful = None
        if self.has_linear:
            horizons = [m.get_num_useful_blocks(request_id) for m in self.managers]
            useful = min(h for h in horizons if h is not None)
        for m in self.managers:
            m.free(request_id, None if isinstance(m, LinearStateManager) else useful)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.managers)

    def get_num_requests(self) -> int:
        return len(self.managers[0].req_to_blocks)

    def get_max_num_blocks(self, max_model_len: int) -> int:
        """Pool blocks one request of ``max_model_len`` tokens can hold at once, all groups."""
        return sum(g.spec.get_max_num_blocks(max_model_len) for g in self.layout.groups)

    def check_integrity(self) -> None:
        for m in self.managers:
            m.check_integrity()
