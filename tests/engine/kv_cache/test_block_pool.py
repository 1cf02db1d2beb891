"""Exact-state tests of the block pool: allocation order, ref counts, the free queue, eviction."""

import pytest

from agentx.engine.kv_cache import BlockPool, FreeBlockQueue, KVBlock, hash_block


def test_free_queue_is_o1_linked_list_in_order():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.get_block_ids() == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert q.get_block_ids() == [0, 1, 3, 4] and q.num_free_blocks == 4
    assert q.popleft() is blocks[0]
    q.appendleft(blocks[2])
    q.append(blocks[0])
    assert q.get_block_ids() == [2, 1, 3, 4, 0]
    for _ in range(5):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_allocate_skips_null_block_and_counts_refs():
    pool = BlockPool(6)
    assert pool.num_free_blocks == 5
    a = pool.allocate_blocks(3)
    assert [b.block_id for b in a] == [1, 2, 3]
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.num_free_blocks == 2
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.allocate_blocks(3)
    pool.touch(a[:2])
    assert [b.ref_cnt for b in a] == [2, 2, 1]
    pool.free_blocks(a)
    assert [b.ref_cnt for b in a] == [1, 1, 0]
    pool.check_integrity()
    pool.free_blocks(a[:2])
    assert pool.num_free_blocks == 5
    pool.check_integrity()


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(6)
    a = pool.allocate_blocks(4)  # 1 2 3 4
    h1, h2 = hash_block(None, [1, 2]), hash_block(None, [3, 4])
    pool.cache_block(a[0], h1)
    pool.cache_block(a[1], h2)
    pool.free_blocks(reversed(a))  # tail first: 4 3 (uncached, to the front) then 2 1 (cached)
    # queue: [3, 4, 5] uncached first ... then cached in free order 2, 1
    assert pool.free_queue.get_block_ids() == [3, 4, 5, 2, 1]
    assert pool.get_cached_block(h1) is a[0]
    pool.check_integrity()
    b = pool.allocate_blocks(4)
    assert [x.block_id for x in b] == [3, 4, 5, 2]
    assert pool.get_cached_block(h2) is None  # block 2 was evicted to serve the allocation
    assert pool.get_cached_block(h1) is a[0]
    assert pool.num_evictions == 1
    pool.check_integrity()


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(4)
    (a,) = pool.allocate_blocks(1)
    h = hash_block(None, [7])
    pool.cache_block(a, h)
    pool.free_blocks([a])
    assert a.ref_cnt == 0 and pool.num_free_blocks == 3
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    assert a.block_id not in pool.free_queue.get_block_ids()
    pool.check_integrity()


def test_duplicate_content_keeps_the_first_copy_cached():
    pool = BlockPool(4)
    a, b = pool.allocate_blocks(2)
    h = hash_block(None, [1])
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.check_integrity()


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4)
    (a,) = pool.allocate_blocks(1)
    pool.cache_block(a, hash_block(None, [1]))
    assert pool.reset_prefix_cache() is False
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and a.block_hash is None
    pool.check_integrity()


def test_hash_chain_depends_on_parent_tokens_and_salt():
    h = hash_block(None, [1, 2, 3])
    assert h == hash_block(None, [1, 2, 3])
    assert h != hash_block(None, [1, 2, 4])
    assert hash_block(h, [5]) != hash_block(None, [5])
    assert hash_block(None, [1, 2, 3], b"salt") != h


def test_soft_pinned_blocks_wait_in_their_own_queue_until_nothing_else_is_free():
    pool = BlockPool(6)  # blocks 1..5
    a = pool.allocate_blocks(3)
    for i, block in enumerate(a):
        pool.cache_block(block, hash_block(None, [i]))
    assert pool.soft_pin([pool.null_block, a[0], a[1]]) == 2  # the null block is skipped
    assert pool.soft_pin([a[0]]) == 0  # already pinned
    pool.free_blocks(reversed(a))
    assert pool.free_queue.get_block_ids() == [4, 5, 3]
    assert pool.pinned_queue.get_block_ids() == [2, 1] and pool.num_free_blocks == 5
    pool.check_integrity()
    pool.touch([a[0]])  # a hit revives a pinned block; freed again, it is pinned still
    assert pool.pinned_queue.get_block_ids() == [2]
    pool.free_blocks([a[0]])
    assert pool.pinned_queue.get_block_ids() == [2, 1]
    pool.demote_blocks([a[0]])  # demotion skips soft-pinned blocks
    assert pool.pinned_queue.get_block_ids() == [2, 1]
    got = pool.allocate_blocks(4)  # the unpinned first, then the least recent pinned
    assert [b.block_id for b in got] == [4, 5, 3, 2]
    assert not a[1].soft_pinned and a[1].block_hash is None  # evicted: the pin ended with it
    pool.check_integrity()
    pool.free_blocks(got)
    assert pool.soft_pin([a[0]], pinned=False) == 1
    assert pool.pinned_queue.get_block_ids() == [] and pool.free_queue.get_block_ids()[-1] == 1
    pool.check_integrity()


def test_dropping_or_resetting_ends_soft_pins():
    pool = BlockPool(4)
    a = pool.allocate_blocks(2)
    for i, block in enumerate(a):
        pool.cache_block(block, hash_block(None, [i]))
    pool.soft_pin(a)
    pool.free_blocks(a)
    pool.drop_cached([a[0]])
    assert pool.free_queue.get_block_ids() == [1, 3] and pool.pinned_queue.get_block_ids() == [2]
    assert pool.reset_prefix_cache()
    assert pool.pinned_queue.get_block_ids() == [] and pool.free_queue.get_block_ids() == [1, 3, 2]
    assert not any(b.soft_pinned for b in pool.blocks)
    pool.check_integrity()
