"""The KV cache manager: the facade the scheduler calls.

It answers in typed records (:class:`KVCacheBlocks`, one block list per KV group) and keeps the
prefix-cache statistics. It does not know how requests are ordered or what the model is.

    get_computed_blocks(request)          -> the prefix hit (no side effects on the pool)
    allocate_slots(request, n, hit)       -> the blocks for n more tokens, or None if they don't fit
    free(request)                         -> every block back to the pool (cached content kept)
"""

from __future__ import annotations

from dataclasses import dataclass

from agentx.engine.kv_cache.block_pool import KVBlock
from agentx.engine.kv_cache.coordinator import GroupBlocks, KVCacheCoordinator
from agentx.engine.kv_cache.specs import KVCacheLayout
from agentx.engine.request import Request


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """Blocks per KV group, as handed between the KV manager and the scheduler."""

    blocks: GroupBlocks

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.blocks)


@dataclass(slots=True)
class PrefixCacheStats:
    num_queries: int = 0  # requests that looked up the cache
    num_query_tokens: int = 0
    num_hit_tokens: int = 0


class KVCacheManager:
    def __init__(self, layout: KVCacheLayout, enable_caching: bool = True) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.enable_caching = enable_caching
        self.coordinator = KVCacheCoordinator(layout, enable_caching)
        self.pool = self.coordinator.pool
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_usage(self) -> float:
        return self.pool.get_usage()

    def empty_blocks(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.layout.groups))

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of the request, and its length in tokens.

        The last token is always recomputed: its logits are needed to sample.
        """
        if not self.enable_caching:
            return self.empty_blocks(), 0
        max_length = request.num_tokens - 1
        blocks, num_hit = self.coordinator.find_longest_cache_hit(request.block_hashes, max_length)
        self.stats.num_queries += 1
        self.stats.num_query_tokens += request.num_tokens
        self.stats.num_hit_tokens += num_hit
        return KVCacheBlocks(blocks), num_hit

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens after taking a prefix hit.

        Returns the newly allocated blocks, or None (nothing changed) when the pool cannot
        hold them right now. Blocks full once these tokens are computed are published to the
        prefix cache now: within one step every KV write happens before any attention read.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        computed = new_computed_blocks.blocks if new_computed_blocks else self.empty_blocks().blocks
        rid = request.request_id
        self.coordinator.remove_skipped_blocks(rid, request.num_computed_tokens)
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = self.coordinator.get_num_blocks_to_allocate(rid, num_total, computed)
        if num_needed > self.pool.num_free_blocks:
            return None
        self.coordinator.save_new_computed_blocks(rid, computed)
        new_blocks = self.coordinator.allocate_new_blocks(rid, num_total)
        if self.enable_caching:
            self.coordinator.cache_blocks(rid, request.block_hashes, num_total)
        return KVCacheBlocks(new_blocks)

    def free(self, request: Request) -> None:
        self.coordinator.free(request.request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants, plus: each held block's ref count equals the number of holders."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        for m in self.coordinator.managers:
            for blocks in m.req_to_blocks.values():
                for block in blocks:
                    if not block.is_null:
                        holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.pool.blocks[1:]:
            expected = holders.get(block.block_id, 0)
            assert block.ref_cnt == expected, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {expected} requests"
            )
        used = sum(1 for b in self.pool.blocks[1:] if b.ref_cnt > 0)
        assert used + self.pool.num_free_blocks == self.pool.num_blocks - 1, "blocks leaked"

    def get_num_used_blocks(self) -> int:
        return self.pool.num_blocks - 1 - self.pool.num_free_blocks


__all__ = ["KVBlock", "KVCacheBlocks", "KVCacheManager", "PrefixCacheStats"]
