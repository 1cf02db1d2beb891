"""Exact-state tests of the KV manager facade: prefix hits, shared blocks, eviction order."""

from tests.helpers.kv import make_manager, make_request


def ids(blocks):
    return blocks.get_block_ids()[0]


def test_cold_request_allocates_and_caches_full_blocks():
    kv = make_manager(10)
    r = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    hit, n = kv.get_computed_blocks(r)
    assert n == 0 and ids(hit) == []
    new = kv.allocate_slots(r, 10)
    assert ids(new) == [1, 2, 3]
    assert len(kv.pool.cached) == 2  # the partial third block is not cached
    assert kv.pool.get_cached_block(r.block_hashes[0]).block_id == 1
    kv.check_integrity()


def test_second_request_hits_shared_prefix_and_shares_blocks():
    kv = make_manager(10)
    a = make_request("a", list(range(10)))
    kv.allocate_slots(a, 10)
    b = make_request("b", list(range(8)) + [99, 98, 97])
    hit, n = kv.get_computed_blocks(b)
    assert n == 8 and ids(hit) == [1, 2]
    assert kv.stats.num_queries == 0  # a lookup has no side effects; taking the hit counts
    new = kv.allocate_slots(b, 3, 8, hit)
    assert ids(new) == [4]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert kv.get_block_ids("b") == ([1, 2, 4],)
    assert kv.stats.num_hit_tokens == 8 and kv.stats.num_query_tokens == 11
    kv.check_integrity()
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    kv.free(b)
    assert kv.get_num_used_blocks() == 0
    kv.check_integrity()


def test_last_token_is_always_recomputed():
    kv = make_manager(10)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8  # the step ran (the scheduler advances this)
    kv.free(a)
    b = make_request("b", list(range(8)))  # identical prompt: all 8 tokens are cached
    hit, n = kv.get_computed_blocks(b)
    assert n == 4 and ids(hit) == [1]  # block 2 would leave nothing to compute
    kv.check_integrity()


def test_hit_on_free_cached_blocks_revives_them():
    kv = make_manager(6)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.free(a)
    assert kv.pool.free_queue.get_block_ids() == [3, 4, 5, 2, 1]
    b = make_request("b", list(range(8)) + [50])
    hit, n = kv.get_computed_blocks(b)
    assert n == 8 and ids(hit) == [1, 2]
    new = kv.allocate_slots(b, 1, 8, hit)
    assert ids(new) == [3]
    assert kv.pool.free_queue.get_block_ids() == [4, 5]
    kv.check_integrity()


def test_allocation_that_does_not_fit_changes_nothing():
    kv = make_manager(4)  # 3 usable blocks
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    b = make_request("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None
    assert kv.get_block_ids("b") == ([],)
    assert kv.pool.num_free_blocks == 1
    kv.check_integrity()


def test_eviction_is_lru_and_tail_first():
    kv = make_manager(7)  # 6 usable
    a = make_request("a", list(range(12)))  # blocks 1 2 3
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    kv.free(a)  # free order: 3 2 1
    b = make_request("b", list(range(200, 208)))  # blocks 4 5
    kv.allocate_slots(b, 8)
    b.num_computed_tokens = 8
    kv.free(b)  # free order: 5 4
    assert kv.pool.free_queue.get_block_ids() == [6, 3, 2, 1, 5, 4]
    c = make_request("c", list(range(300, 312)))  # needs 3: takes 6, then evicts 3, 2
    kv.allocate_slots(c, 12)
    assert kv.get_block_ids("c") == ([6, 3, 2],)
    assert kv.pool.num_evictions == 2
    d = make_request("d", list(range(12)) + [1])
    hit, n = kv.get_computed_blocks(d)
    assert n == 4 and ids(hit) == [1]  # a's first block survived; its 2nd and 3rd were evicted
    kv.check_integrity()


def test_concurrent_requests_share_blocks_computed_in_the_same_step():
    kv = make_manager(10)
    a = make_request("a", list(range(9)))
    b = make_request("b", list(range(9)))
    kv.allocate_slots(a, 9)  # caches blocks 1, 2 before they are computed (same-step writes)
    hit, n = kv.get_computed_blocks(b)
    assert n == 8 and ids(hit) == [1, 2]
    kv.allocate_slots(b, 1, 8, hit)
    assert kv.get_block_ids("b") == ([1, 2, 4],)
    assert kv.pool.blocks[1].ref_cnt == 2
    kv.free(a)
    kv.free(b)
    assert kv.get_num_used_blocks() == 0
    kv.check_integrity()


def test_salt_isolates_prefixes():
    kv = make_manager(10)
    a = make_request("a", list(range(9)), cache_salt=b"tenant-1")
    kv.allocate_slots(a, 9)
    b = make_request("b", list(range(9)), cache_salt=b"tenant-2")
    _, n = kv.get_computed_blocks(b)
    assert n == 0
    c = make_request("c", list(range(9)), cache_salt=b"tenant-1")
    _, n = kv.get_computed_blocks(c)
    assert n == 8


def test_caching_disabled_never_hits():
    kv = make_manager(10, caching=False)
    a = make_request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.free(a)
    b = make_request("b", list(range(9)))
    _, n = kv.get_computed_blocks(b)
    assert n == 0 and kv.pool.cached == {}
    kv.check_integrity()


def test_output_tokens_extend_the_hash_chain():
    kv = make_manager(10)
    a = make_request("a", list(range(6)))
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    for t in (100, 101):
        a.append_output_token(t)
    assert len(a.block_hashes) == 2  # 8 tokens: the second block is full now
    kv.allocate_slots(a, 1)
    a.num_computed_tokens = 7
    kv.allocate_slots(a, 1)
    assert len(kv.pool.cached) == 2
    b = make_request("b", list(range(6)) + [100, 101, 5])
    _, n = kv.get_computed_blocks(b)
    assert n == 8


def test_blocks_published_but_never_computed_are_forgotten_on_free():
    """A request preempted in the step that scheduled it published blocks its KV never
    reached: they must not serve a later hit."""
    kv = make_manager(10)
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 4  # only the first block ran before the request was freed
    assert len(kv.pool.cached) == 3
    kv.free(a)
    assert len(kv.pool.cached) == 1
    assert kv.pool.free_queue.get_block_ids()[:2] == [2, 3]  # uncached: reused first
    b = make_request("b", list(range(12)) + [5])
    hit, n = kv.get_computed_blocks(b)
    assert n == 4 and ids(hit) == [1]
    kv.check_integrity()


def test_a_lookup_counts_once_when_its_request_takes_the_hit():
    kv = make_manager(5)  # 4 blocks of 4 tokens
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8, 0, kv.get_computed_blocks(a)[0])  # blocks 1, 2
    c = make_request("c", [100, 101, 102, 103])
    kv.allocate_slots(c, 4)  # block 3; no lookup, no query
    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    hit, n = kv.get_computed_blocks(b)
    assert n == 8 and kv.allocate_slots(b, 5, n, hit) is None  # 2 more blocks, 1 free
    assert (kv.stats.num_queries, kv.stats.num_query_tokens, kv.stats.num_hit_tokens) == (1, 8, 0)
    kv.free(c)
    hit, n = kv.get_computed_blocks(b)
    # c never computed its block: uncached on free, it is reused first
    assert ids(kv.allocate_slots(b, 5, n, hit)) == [3, 4]
    assert (kv.stats.num_queries, kv.stats.num_query_tokens, kv.stats.num_hit_tokens) == (2, 21, 8)
    kv.check_integrity()
