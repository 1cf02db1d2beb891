"""The coordinator: one prefix-hit length, one allocation and one free across all KV groups.

Every group draws from the same pool. A prefix hit must hold in every group, so the hit length
is narrowed group by group until all agree (full attention needs the whole prefix, other types
only what their spec says), then every group's hit is cut to that length.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentx.engine.kv_cache.block_pool import BlockPool, KVBlock
from agentx.engine.kv_cache.hashing import BlockHash
from agentx.engine.kv_cache.single_type import SingleTypeKVManager, make_manager
from agentx.engine.kv_cache.specs import KVCacheLayout

GroupBlocks = tuple[list[KVBlock], ...]


class KVCacheCoordinator:
    def __init__(self, layout: KVCacheLayout, enable_caching: bool) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.pool = BlockPool(layout.num_blocks, enable_caching)
        self.managers: tuple[SingleTypeKVManager, ...] = tuple(
            make_manager(g.spec, self.pool, i) for i, g in enumerate(layout.groups)
        )

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[GroupBlocks, int]:
        hit_length = max_length
        while True:
            hits = [m.find_longest_cache_hit(block_hashes, hit_length) for m in self.managers]
            new_length = min(len(h) for h in hits) * self.block_size
            if new_length == hit_length or new_length == 0:
                hit_length = new_length
                break
            hit_length = new_length
        num_blocks = hit_length // self.block_size
        return tuple(h[:num_blocks] for h in hits), hit_length

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed: GroupBlocks
    ) -> int:
        return sum(
            m.get_num_blocks_to_allocate(request_id, num_tokens, new_computed[i])
            for i, m in enumerate(self.managers)
        )

    def save_new_computed_blocks(self, request_id: str, new_computed: GroupBlocks) -> None:
        for i, m in enumerate(self.managers):
            m.save_new_computed_blocks(request_id, new_computed[i])

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> GroupBlocks:
        return tuple(m.allocate_new_blocks(request_id, num_tokens) for m in self.managers)

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> None:
        for m in self.managers:
            m.cache_blocks(request_id, block_hashes, num_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def take(self, request_id: str) -> GroupBlocks:
        return tuple(m.take(request_id) for m in self.managers)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.managers)

    def get_num_requests(self) -> int:
        return len(self.managers[0].req_to_blocks)
