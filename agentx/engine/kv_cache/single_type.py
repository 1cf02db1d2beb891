"""Per-attention-type managers: which blocks a request holds in one KV group.

A manager owns the request -> blocks map of its group and asks the shared :class:`BlockPool`
for blocks. It knows nothing of scheduling or tensors. Subclasses differ in how a prefix hit is
found and which blocks may be dropped while a request runs (sliding window drops blocks that
left the window; full attention drops none; linear state keeps only checkpoints).

Every group draws from one pool, so a cached block is published under its hash tagged with the
group: the same prefix has one block per group, each holding that group's layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from agentx.engine.block_hash import BlockHash, parent_key
from agentx.engine.kv_cache.block_pool import BlockPool, KVBlock
from agentx.engine.kv_cache.retention import RetentionPolicy
from agentx.engine.kv_cache.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from agentx.engine.request import Request


class SingleTypeKVManager(ABC):
    """Blocks held by each request in one KV group.

    Callers (the coordinator) must check ``get_num_blocks_to_allocate`` against the pool before
    ``allocate_new_blocks``; every method mutates only this manager and the pool.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        pool: BlockPool,
        group_id: int,
        retention: RetentionPolicy | None = None,
    ) -> None:
        """``retention`` is for managers that checkpoint (linear state); others ignore it."""
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # publish blocks with their token ids, as partial-hit sources (the coordinator sets it
        # where a partial hit is possible: one full-attention group)
        self.partial_sources = False

    def key(self, block_hash: BlockHash) -> BlockHash:
        """The pool key of this group's block for ``block_hash`` (group 0: the hash itself)."""
        return block_hash if self.group_id == 0 else block_hash + bytes((self.group_id,))

    def get_cached(self, block_hash: BlockHash) -> KVBlock | None:
        return self.pool.get_cached_block(self.key(block_hash))

    def get_num_blocks_to_allocate(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: Sequence[KVBlock],
        keep_checkpoints: bool = True,
    ) -> int:
        """Pool blocks consumed if the request grows to ``num_tokens`` after taking the hit.

        A hit block that is free right now also leaves the free queue, so it counts.
        ``keep_checkpoints=False``: only the blocks the step cannot run without (a manager
        that checkpoints leaves its checkpoints out; the others need every block anyway).
        """
        num_required = -(-num_tokens // self.block_size)
        num_held = len(self.req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        num_new = max(0, num_required - num_held)
        return num_new + _num_revived(new_computed_blocks)

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVBlock]
    ) -> None:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if new_computed_blocks:
            assert not blocks, "a prefix hit is only taken by a request holding no blocks"
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            # published blocks form a prefix (nulls stand for dropped ones); a held
            # sequence's partial tail block is not one
            num_published = 0
            for block in new_computed_blocks:
                if not block.is_null and block.block_hash is None:
                    break
                num_published += 1
            self.num_cached_blocks[request_id] = num_published

    def allocate_new_blocks(
        self, request: Request, num_tokens: int, keep_checkpoints: bool = True
    ) -> list[KVBlock]:
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_new = -(-num_tokens // self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.pool.allocate_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's blocks that are full within its first ``num_tokens`` tokens."""
        rid = request.request_id
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        num_done = self.num_cached_blocks.get(rid, 0)
        if num_full <= num_done:
            return
        blocks, hashes = self.req_to_blocks[rid], request.block_hashes
        size, tokens = self.block_size, request.all_token_ids
        for i in range(num_done, num_full):
            if blocks[i].is_null:
                continue
            if self.partial_sources:
                parent = parent_key(hashes, i, request.cache_salt)
                own = tuple(tokens[i * size : (i + 1) * size])
                self.pool.cache_block(blocks[i], self.key(hashes[i]), parent, own)
            else:
                self.pool.cache_block(blocks[i], self.key(hashes[i]))
        self.num_cached_blocks[rid] = num_full

    def take(self, request_id: str) -> list[KVBlock]:
        """Detach the request's blocks without releasing them (their references move along)."""
        self.num_cached_blocks.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, [])

    def free(self, request_id: str, num_useful_blocks: int | None = None) -> None:
        """Release every block of the request, tail first so the prefix is evicted last.

        Blocks from ``num_useful_blocks`` on can be part of no future hit (the hybrid
        coordinator knows): they go to the front of the free queue, to be reused first.
        """
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        if num_useful_blocks is not None and num_useful_blocks < len(blocks):
            self.pool.free_blocks(blocks[num_useful_blocks:], front=True)
            blocks = blocks[:num_useful_blocks]
        self.pool.free_blocks(reversed(blocks))

    def trim(self, request_id: str, num_blocks: int) -> int:
        """Release the request's blocks past its first ``num_blocks`` (the slots of rejected
        drafts), last first; returns how many went back."""
        blocks = self.req_to_blocks.get(request_id, [])
        dropped = blocks[num_blocks:]
        if not dropped:
            return 0
        del blocks[num_blocks:]
        if self.num_cached_blocks.get(request_id, 0) > num_blocks:
            self.num_cached_blocks[request_id] = num_blocks
        self.pool.free_blocks(reversed(dropped))
        return len(dropped)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:  # noqa: B027
        """Return blocks no future token of the request reads (none, by default)."""

    def get_num_useful_blocks(self, request_id: str) -> int | None:
        """Leading blocks of the request that a future hit could use (None: all of them)."""
        return None

    def get_hit_block_indices(self, num_blocks: int) -> range:
        """The entries a hit of ``num_blocks`` blocks reads in this group (the others may be
        null): what a lower tier must hand back for such a hit. All of them, by default."""
        return range(num_blocks)

    def get_exact_hit_entries(self, num_tokens: int) -> tuple[range, bool]:
        """What resuming at exactly ``num_tokens`` tokens reads in this group (a hand-over):
        the full blocks, by entry, and whether the last entry is a page no prefix hash names
        (a partial block; a linear state). All full blocks and the partial one, by default."""
        return range(num_tokens // self.block_size), num_tokens % self.block_size != 0

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVBlock]:
        """The blocks of the longest prefix of at most ``max_length`` tokens that this group
        can resume from (null blocks where it needs nothing); a shorter prefix may be usable
        even when a longer one is not."""

    def check_integrity(self) -> None:  # noqa: B027
        """Manager-specific invariants (the facade checks ref counts across groups)."""


class FullAttentionManager(SingleTypeKVManager):
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVBlock]:
        hit: list[KVBlock] = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.get_cached(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit


class SlidingWindowManager(SingleTypeKVManager):
    """Blocks wholly outside the window of every future query go back to the pool while the
    request runs; a hit needs only the blocks of the last window before the hit point.

        positions   [ 0 .. p-W ]  [ p-W+1 .. p-1 ]  p
        blocks      null, null..  cached            first token computed (sees W-1 before it)
    """

    spec: SlidingWindowSpec

    def __init__(
        self,
        spec: KVCacheSpec,
        pool: BlockPool,
        group_id: int,
        retention: RetentionPolicy | None = None,
    ) -> None:
        super().__init__(spec, pool, group_id)
        assert isinstance(spec, SlidingWindowSpec)
        self.window = spec.sliding_window
        # blocks that must be cached right before a hit point: they cover its W-1 earlier tokens
        self.num_window_blocks = -(-(self.window - 1) // self.block_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVBlock]:
        max_blocks = min(max_length // self.block_size, len(block_hashes))
        null = self.pool.null_block
        run: list[KVBlock] = []  # cached blocks found right to left, contiguous
        for i in range(max_blocks - 1, -1, -1):
            block = self.get_cached(block_hashes[i])
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) >= self.num_window_blocks:
                return [null] * i + run[::-1]
        return run[::-1]  # a run reaching block 0: the whole (short) prefix is cached

    def get_hit_block_indices(self, num_blocks: int) -> range:
        return range(max(0, num_blocks - self.num_window_blocks), num_blocks)

    def get_exact_hit_entries(self, num_tokens: int) -> tuple[range, bool]:
        # the next query, at num_tokens, sees its W-1 tokens before: the blocks holding them
        first = max(0, num_tokens - self.window + 1) // self.block_size
        return range(first, num_tokens // self.block_size), num_tokens % self.block_size != 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        # the next query sits at num_computed_tokens and sees from num_computed - W + 1 on
        num_skipped = max(0, num_computed_tokens - self.window + 1) // self.block_size
        null = self.pool.null_block
        dropped = []
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break  # everything before was dropped earlier
            dropped.append(blocks[i])
            blocks[i] = null
        self.pool.free_blocks(dropped)


def _num_revived(blocks: Sequence[KVBlock]) -> int:
    return sum(1 for b in blocks if b.ref_cnt == 0 and not b.is_null)


_MANAGERS: dict[type[KVCacheSpec], type[SingleTypeKVManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def register_manager(spec_cls: type[KVCacheSpec], manager_cls: type[SingleTypeKVManager]) -> None:
    _MANAGERS[spec_cls] = manager_cls


def make_manager(
    spec: KVCacheSpec,
    pool: BlockPool,
    group_id: int,
    retention: RetentionPolicy | None = None,
) -> SingleTypeKVManager:
    try:
        cls = _MANAGERS[type(spec)]
    except KeyError:
        raise TypeError(f"no KV manager registered for {type(spec).__name__}") from None
    return cls(spec, pool, group_id, retention)
