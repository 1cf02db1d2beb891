"""Per-attention-type managers: which blocks a request holds in one KV group.

A manager owns the request -> blocks map of its group and asks the shared :class:`BlockPool`
for blocks. It knows nothing of scheduling or tensors. Subclasses differ in how a prefix hit is
found and which blocks may be dropped while a request runs (sliding window drops blocks that
left the window; full attention drops none).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from agentx.engine.kv_cache.block_pool import BlockPool, KVBlock
from agentx.engine.kv_cache.hashing import BlockHash
from agentx.engine.kv_cache.specs import FullAttentionSpec, KVCacheSpec


class SingleTypeKVManager(ABC):
    """Blocks held by each request in one KV group.

    Callers (the coordinator) must check ``get_num_blocks_to_allocate`` against the pool before
    ``allocate_new_blocks``; every method mutates only this manager and the pool.
    """

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVBlock]
    ) -> int:
        """Pool blocks consumed if the request grows to ``num_tokens`` after taking the hit.

        A hit block that is free right now also leaves the free queue, so it counts.
        """
        num_required = -(-num_tokens // self.block_size)
        num_held = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        num_new = max(0, num_required - num_held)
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_revived

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVBlock]
    ) -> None:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if new_computed_blocks:
            assert not blocks, "a prefix hit is only taken by a request holding no blocks"
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            # published blocks form a prefix; a held sequence's partial tail block is not one
            num_published = sum(1 for b in new_computed_blocks if b.block_hash is not None)
            self.num_cached_blocks[request_id] = num_published

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = -(-num_tokens // self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.pool.allocate_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> None:
        """Publish the request's blocks that are full within its first ``num_tokens`` tokens."""
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        num_done = self.num_cached_blocks.get(request_id, 0)
        if num_full <= num_done:
            return
        blocks = self.req_to_blocks[request_id]
        for i in range(num_done, num_full):
            if not blocks[i].is_null:
                self.pool.cache_block(blocks[i], block_hashes[i])
        self.num_cached_blocks[request_id] = num_full

    def take(self, request_id: str) -> list[KVBlock]:
        """Detach the request's blocks without releasing them (their references move along)."""
        self.num_cached_blocks.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, [])

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first so the prefix is evicted last."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(request_id, None)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:  # noqa: B027
        """Return blocks no future token of the request attends to (none, by default)."""

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVBlock]:
        """The cached blocks of the longest usable prefix of at most ``max_length`` tokens."""


class FullAttentionManager(SingleTypeKVManager):
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVBlock]:
        hit: list[KVBlock] = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit


_MANAGERS: dict[type[KVCacheSpec], type[SingleTypeKVManager]] = {
    FullAttentionSpec: FullAttentionManager,
}


def make_manager(spec: KVCacheSpec, pool: BlockPool, group_id: int) -> SingleTypeKVManager:
    try:
        cls = _MANAGERS[type(spec)]
    except KeyError:
        raise TypeError(f"no KV manager registered for {type(spec).__name__}") from None
    return cls(spec, pool, group_id)
