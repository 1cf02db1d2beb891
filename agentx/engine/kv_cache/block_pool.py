"""The block pool: every KV page of the engine, its reference counts and the prefix-cache index.

The pool knows blocks, hashes and reference counts; it does not know requests, attention types
or tensors. Layout of the free queue (intrusive doubly-linked list, O(1) everywhere)::

    head -> [never cached / dead blocks ...][cached blocks, least recently freed first] <- tail
            reused first                     evicted (hash dropped) only when popped
    pinned: [soft-pinned cached blocks, least recently freed first]
            popped only when the queue above is empty

A block with ``ref_cnt == 0`` is in one of the two free queues; one with ``ref_cnt > 0`` is in
neither. A soft pin (a KV policy's decision, ``soft_pin``) is a property of cached content: it
ends when the block's hash is dropped. A block that
holds cached content keeps its hash while free, so a later request can revive it with ``touch``.
Block 0 is the null block: never allocated, used as padding in block tables.

Partial hits: a cached block published with its token ids (``cache_block(..., parent_key,
token_ids)``) is also indexed under its parent's key (so is a freed request's partial last
block, under a key of its computed tokens that no full block's hash equals), so a prompt that
shares only the first tokens of the block after its last full hit can copy them
(``find_partial``) instead of computing them again. A block published in the current step
(``begin_step``) is no source yet: its KV is written by the step that published it, after
any copy runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from agentx.engine.block_hash import NULL_BLOCK_ID, BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)
    is_null: bool = False
    soft_pinned: bool = False
    # set while the block is a partial-hit source (BlockPool.children): its parent's pool key,
    # its token ids and the step that published it
    parent_key: BlockHash | None = field(default=None, repr=False)
    token_ids: tuple[int, ...] | None = field(default=None, repr=False)
    cached_step: int = field(default=0, repr=False)


class FreeBlockQueue:
    """Doubly-linked list of free blocks threaded through the blocks themselves."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVBlock, block: KVBlock) -> None:
        nxt = prev.next_free
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    """All KV blocks, the free queue and the hash -> block index of cached blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.is_null = True
        self.null_block.ref_cnt = 1  # permanently held so it never enters the free queue
        self.free_queue = FreeBlockQueue(self.blocks[NULL_BLOCK_ID + 1 :])
        self.pinned_queue = FreeBlockQueue(())  # free soft-pinned cached blocks
        self.cached: dict[BlockHash, KVBlock] = {}
        # (parent pool key, first token) -> {block id: cached block published with its token
        # ids}: a lookup reads only the blocks that share a token with the prompt
        self.children: dict[tuple[BlockHash, int], dict[int, KVBlock]] = {}
        self.step = 0  # begin_step() counts; a partial source must predate the current one
        self.num_evictions = 0
        # blocks published since the last take_published(), for the offload tiers (None: off)
        self.published: list[tuple[BlockHash, KVBlock]] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks + self.pinned_queue.num_free_blocks

    def _queue(self, block: KVBlock) -> FreeBlockQueue:
        return self.pinned_queue if block.soft_pinned else self.free_queue

    def get_usage(self) -> float:
        """Fraction of allocatable blocks held by a request (cached free blocks count as free)."""
        total = self.num_blocks - 1
        return (total - self.num_free_blocks) / total

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop ``num_blocks`` blocks off the free queue (evicting their cached content)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            queue = self.free_queue if self.free_queue.num_free_blocks else self.pinned_queue
            block = queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block, reviving free cached blocks."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self._queue(block).remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock], front: bool = False) -> None:
        """Drop one reference from each block, in the order given (that is the eviction order).

        Blocks reaching zero references that hold no cached content, or that the caller knows
        no future hit can use (``front``), go to the queue's front, so they are reused before
        blocks a later request could still hit.
        """
        for block in blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.soft_pinned:
                    self.pinned_queue.append(block)
                elif block.block_hash is None or front:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def begin_step(self) -> None:
        """A new step is being scheduled: blocks published from now on are written by it."""
        self.step += 1

    def cache_block(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        parent_key: BlockHash | None = None,
        token_ids: tuple[int, ...] | None = None,
        publish: bool = True,
    ) -> None:
        """Publish a full, computed block under ``block_hash`` (first writer wins); with
        ``token_ids``, also as a partial-hit source under ``parent_key``. ``publish=False``:
        a partial block's tokens under a key no full block has (a source only), left out of the
        log the offload tiers store from."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # another request computed the same content; this copy stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if token_ids is not None and parent_key is not None:
            block.parent_key, block.token_ids, block.cached_step = parent_key, token_ids, self.step
            self.children.setdefault((parent_key, token_ids[0]), {})[block.block_id] = block
        if self.published is not None and publish:
            self.published.append((block_hash, block))

    def find_partial(
        self, parent_key: BlockHash, token_ids: list[int] | tuple[int, ...]
    ) -> tuple[KVBlock | None, int]:
        """The cached block under ``parent_key`` whose token ids share the longest prefix with
        ``token_ids`` (the first such block on a tie), and that prefix's length; (None, 0)
        when none shares a token. Blocks published in the current step are left out."""
        best, best_len = None, 0
        if not token_ids:
            return best, best_len
        for block in self.children.get((parent_key, token_ids[0]), {}).values():
            if block.cached_step == self.step:
                continue
            n = _common_prefix(block.token_ids, token_ids)
            if n > best_len:
                best, best_len = block, n
        return best, best_len

    def take_published(self) -> list[tuple[BlockHash, KVBlock]]:
        """Drain the (hash, block) pairs published since the last call, still cached as such."""
        if not self.published:
            return []
        out, self.published = self.published, []
        return [(h, b) for h, b in out if b.block_hash == h]

    def drop_cached(self, blocks: Iterable[KVBlock]) -> None:
        """Forget the cached content of free blocks and queue them to be reused first."""
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash is not None:
                self._queue(block).remove(block)
                self._evict(block)
                self.free_queue.appendleft(block)

    def demote_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Free cached blocks to be reused before other cached ones (a lower tier keeps their
        content); given prefix first, so the tail is evicted first. Held and soft-pinned
        blocks are skipped."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null and not block.soft_pinned:
                self.free_queue.remove(block)
                self.free_queue.appendleft(block)

    def uncache_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Forget the cached content of blocks (held or free); free ones move to the front."""
        for block in blocks:
            if block.block_hash is None:
                continue
            queue = self._queue(block)
            self._evict(block)
            if block.ref_cnt == 0:
                queue.remove(block)
                self.free_queue.appendleft(block)

    def soft_pin(self, blocks: Iterable[KVBlock], pinned: bool = True) -> int:
        """Mark cached blocks to be evicted last (``pinned``) or like any other; blocks without
        cached content are skipped (nothing to keep). Returns the blocks whose mark changed."""
        num = 0
        for block in blocks:
            if block.is_null or block.block_hash is None or block.soft_pinned == pinned:
                continue
            if block.ref_cnt == 0:
                self._queue(block).remove(block)
            block.soft_pinned = pinned
            if block.ref_cnt == 0:
                self._queue(block).append(block)
            num += 1
        return num

    def _evict(self, block: KVBlock) -> None:
        """Drop the block's cached content (and its soft pin); the caller requeues it."""
        block.soft_pinned = False
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        if block.token_ids is not None:
            key = (block.parent_key, block.token_ids[0])
            siblings = self.children[key]
            del siblings[block.block_id]
            if not siblings:
                del self.children[key]
            block.parent_key = block.token_ids = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in list(self.pinned_queue):
            self.pinned_queue.remove(block)
            self.free_queue.append(block)
        for block in self.blocks[1:]:
            block.block_hash = None
            block.soft_pinned = False
            block.parent_key = block.token_ids = None
        self.cached.clear()
        self.children.clear()
        return True

    def check_integrity(self) -> None:
        free = list(self.free_queue) + list(self.pinned_queue)
        assert len(free) == self.num_free_blocks, "free count drifted from the queue"
        assert all(b.soft_pinned for b in self.pinned_queue), "an unpinned block in pinned queue"
        assert not any(b.soft_pinned for b in self.free_queue), "a pinned block in the free queue"
        for block in self.blocks:
            assert not block.soft_pinned or block.block_hash is not None, (
                f"block {block.block_id} is soft-pinned without cached content"
            )
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "a block is twice in the free queue"
        assert 0 not in free_ids, "the null block is in the free queue"
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} disagrees with the free queue"
            )
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"block {block.block_id} hash index is stale"
        num_hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert num_hashed == len(self.cached), "a hashed block is missing from the index"
        for (parent_key, first), siblings in self.children.items():
            assert siblings, "an empty partial-source entry"
            for block_id, block in siblings.items():
                assert block.block_id == block_id and block.parent_key == parent_key, (
                    f"block {block_id}: stale partial-source entry"
                )
                assert block.token_ids and block.token_ids[0] == first, (
                    f"block {block_id}: filed under another first token"
                )
                assert block.block_hash is not None and self.cached[block.block_hash] is block, (
                    f"block {block_id} is a partial source without cached content"
                )
        num_sources = sum(1 for b in self.blocks if b.token_ids is not None)
        assert num_sources == sum(len(s) for s in self.children.values()), (
            "a partial source is missing from the index"
        )


def _common_prefix(a: tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
