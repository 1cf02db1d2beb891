"""Partial prefix hits: a hit goes on past its whole blocks into a partly shared cached block,
whose shared tokens are copied into the request's own block (exact block ids, copies, ref
counts), and through the engine the copied KV gives every prompt's tokens alone, exactly.

Manager tests use 4-token blocks (tests/helpers/kv.py); ``kv.begin_step()`` stands for the
scheduler starting the next step (a block published in the current one is no source yet).
"""

from dataclasses import replace

import pytest

from agentx import CacheConfig, SamplingParams
from agentx.engine.kv_cache import (
    BlockCopy,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheManager,
    SlidingWindowSpec,
)
from tests.helpers.kv import FULL, make_request


def make_manager(num_blocks: int, partial_hits: bool = True) -> KVCacheManager:
    layout = KVCacheLayout(num_blocks, (KVCacheGroup(FULL, (0,)),))
    return KVCacheManager(layout, partial_hits=partial_hits)


def compute(kv, rid, tokens, **kw):
    """Take the request's hit, compute the rest of its prompt, and return it (still running)."""
    r = make_request(rid, tokens, **kw)
    hit, n = kv.get_computed_blocks(r)
    kv.allocate_slots(r, len(tokens) - n, n, hit)
    r.num_computed_tokens = len(tokens)
    return r


def ids(blocks):
    return blocks.get_block_ids()[0]


def test_hit_goes_on_into_a_partly_shared_block():
    kv = make_manager(10)
    a = compute(kv, "a", list(range(10)))  # blocks 1, 2 full (published), 3 partial
    kv.begin_step()
    b = make_request("b", [0, 1, 2, 3, 4, 5, 99, 98])
    hit, n = kv.get_computed_blocks(b)
    assert n == 6 and ids(hit) == [1] and hit.partial_src.block_id == 2
    new = kv.allocate_slots(b, 2, 6, hit)
    assert ids(new) == [4]
    assert kv.take_block_copies() == [BlockCopy(2, 4)]
    assert kv.take_block_copies() == []  # taken once
    assert kv.get_block_ids("b") == ([1, 4],)
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 1, 1, 1]
    assert kv.stats.num_hit_tokens == 6 and kv.stats.num_query_tokens == 10 + 8
    kv.check_integrity()
    kv.free(a)
    b.num_computed_tokens = 8
    kv.free(b)
    assert kv.get_num_used_blocks() == 0
    kv.check_integrity()


def test_every_token_but_the_last_of_a_repeated_prompt_is_a_hit():
    kv = make_manager(10)
    a = compute(kv, "a", list(range(8)))
    kv.free(a)
    kv.begin_step()
    b = make_request("b", list(range(8)))
    hit, n = kv.get_computed_blocks(b)
    assert n == 7 and ids(hit) == [1] and hit.partial_src.block_id == 2  # 3 of block 2's 4
    assert ids(kv.allocate_slots(b, 1, 7, hit)) == [3]
    assert kv.take_block_copies() == [BlockCopy(2, 3)]
    kv.check_integrity()


def test_block_published_in_the_current_step_is_no_source():
    kv = make_manager(10)
    compute(kv, "a", list(range(10)))  # its KV is written by the step being scheduled
    b = make_request("b", [0, 1, 2, 3, 4, 5, 99])
    hit, n = kv.get_computed_blocks(b)
    assert n == 4 and hit.partial_src is None
    kv.begin_step()
    assert kv.get_computed_blocks(b)[1] == 6


def test_first_block_partial_hit_and_cache_salt():
    kv = make_manager(10)
    compute(kv, "a", [7, 8, 9, 10, 11], cache_salt=b"x")
    kv.begin_step()
    other_salt = make_request("b", [7, 8, 9, 50])
    assert kv.get_computed_blocks(other_salt)[1] == 0
    same_salt = make_request("c", [7, 8, 9, 50], cache_salt=b"x")
    hit, n = kv.get_computed_blocks(same_salt)
    assert n == 3 and ids(hit) == [] and hit.partial_src.block_id == 1


def test_longest_shared_sibling_wins():
    kv = make_manager(12)
    compute(kv, "a", [0, 1, 2, 3, 4, 5, 60, 61, 62])  # block 2: 4 5 60 61
    compute(kv, "b", [0, 1, 2, 3, 4, 5, 6, 70, 71])  # block 4: 4 5 6 70
    kv.begin_step()
    c = make_request("c", [0, 1, 2, 3, 4, 5, 6, 80, 81])
    hit, n = kv.get_computed_blocks(c)
    assert n == 7 and ids(hit) == [1] and hit.partial_src.block_id == 4
    d = make_request("d", [0, 1, 2, 3, 4, 90])  # shares 1 token with both: the first published
    hit, n = kv.get_computed_blocks(d)
    assert n == 5 and hit.partial_src.block_id == 2
    kv.check_integrity()


def test_evicted_source_leaves_the_index():
    kv = make_manager(5)  # 4 usable blocks
    a = compute(kv, "a", list(range(10)))
    kv.free(a)
    kv.begin_step()
    # under the root key, block 1's hash and block 2's (a's partial last block, 2 tokens)
    assert sorted(first for _, first in kv.pool.children) == [0, 4, 8]
    big = compute(kv, "big", list(range(100, 116)))  # takes all 4 blocks: a's are evicted
    sources = [b for siblings in kv.pool.children.values() for b in siblings.values()]
    assert [(b.block_id, b.token_ids[0]) for b in sources] == [
        (4, 100),
        (3, 104),
        (2, 108),
        (1, 112),
    ]
    kv.check_integrity()
    kv.free(big)
    kv.begin_step()
    assert kv.get_computed_blocks(make_request("b", [0, 1, 2, 3, 4, 5, 99]))[1] == 0
    kv.check_integrity()


def test_a_freed_requests_partial_last_block_is_a_source():
    """The next chat turn repeats the last one's tokens (prompt, then output): the tokens
    computed into its partial last block are copied, not computed again."""
    kv = make_manager(10)
    kv.enable_publish_log()
    a = compute(kv, "a", list(range(10)))  # blocks 1, 2 full; 3 holds tokens 8 and 9
    assert [b.block_id for _, b in kv.take_published()] == [1, 2]
    kv.free(a)
    assert kv.take_published() == []  # a tail is no page for the tiers
    assert kv.pool.blocks[3].token_ids == (8, 9)
    # cached: evicted in LRU order, the request's prefix last
    assert kv.pool.free_queue.get_block_ids()[-3:] == [3, 2, 1]
    kv.begin_step()
    b = make_request("b", list(range(10)) + [50, 51])
    hit, n = kv.get_computed_blocks(b)
    assert n == 10 and ids(hit) == [1, 2] and hit.partial_src.block_id == 3
    assert ids(kv.allocate_slots(b, 2, 10, hit)) == [4]
    assert kv.take_block_copies() == [BlockCopy(3, 4)]
    kv.check_integrity()


def test_released_held_tail_is_a_source_unless_adopted():
    kv = make_manager(10)
    a = compute(kv, "a", list(range(6)), hold_kv=True)
    kv.hold(a)  # blocks 1 (full), 2 (tokens 4, 5)
    b = make_request("b", list(range(6)) + [70], held_kv="a")
    hit, n = kv.get_computed_blocks(b)
    assert n == 6 and hit.held_kv == "a"
    kv.allocate_slots(b, 1, 6, hit)  # adopts a's blocks: its tail is b's to write now
    assert "a" not in kv.held and kv.pool.blocks[2].token_ids is None
    b.num_computed_tokens = 7
    kv.hold(b)
    kv.release_held("b")  # b alone held it: its 3 tokens stay a source
    assert kv.pool.blocks[2].token_ids == (4, 5, 70)
    kv.begin_step()
    c = make_request("c", list(range(6)) + [70, 80])
    hit, n = kv.get_computed_blocks(c)
    assert n == 7 and hit.partial_src.block_id == 2
    kv.check_integrity()


def test_whole_block_hits_when_off_or_not_one_full_attention_group():
    off = make_manager(10, partial_hits=False)
    compute(off, "a", list(range(10)))
    off.begin_step()
    assert off.get_computed_blocks(make_request("b", [0, 1, 2, 3, 4, 5, 99]))[1] == 4
    assert off.pool.children == {}
    window = SlidingWindowSpec(4, num_kv_heads=1, head_size=8, dtype=FULL.dtype, sliding_window=8)
    groups = (KVCacheGroup(FULL, (0,)), KVCacheGroup(window, (1,)))
    hybrid = KVCacheManager(KVCacheLayout(20, groups), partial_hits=True)
    assert not hybrid.partial_hits
    compute(hybrid, "a", list(range(10)))
    hybrid.begin_step()
    assert hybrid.get_computed_blocks(make_request("b", [0, 1, 2, 3, 4, 5, 99]))[1] == 4


def test_prompt_logprobs_take_no_partial_hit():
    kv = make_manager(10)
    compute(kv, "a", list(range(10)))
    kv.begin_step()
    r = make_request("b", [0, 1, 2, 3, 4, 5, 99])
    r.sampling = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    assert kv.get_computed_blocks(r)[1] == 0


# ---- through the engine (the default model) ----------------------------------------------------

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_copied_tokens_give_the_tokens_computed_alone(make_engine, default_engine, kv_dtype):
    """A prompt sharing 27 tokens with an earlier one (one whole block and 11 tokens of the
    next) takes 27 cached tokens, and its greedy tokens are those of an engine without
    prefix caching, exactly; nothing leaks."""
    tok = default_engine.tokenizer
    base = tok.encode("def quicksort(items):\n    if len(items) <= 1:\n        return items\n" * 2)
    assert len(base) >= 40
    other = base[:27] + tok.encode(" pivot = items[len(items) // 2]\n    left = []")
    cache = CacheConfig(kv_cache_bytes=64 << 20, kv_cache_dtype=kv_dtype)
    cold = make_engine(cache=replace(cache, enable_prefix_caching=False))
    warm = make_engine(cache=cache)
    expected = [g.token_ids for g in cold.generate([base, other], GREEDY)]
    first = warm.generate([base], GREEDY)[0]
    second = warm.generate([other], GREEDY)[0]
    assert first.usage.cached_tokens == 0 and second.usage.cached_tokens == 27
    assert [first.token_ids, second.token_ids] == expected
    # its own blocks now: the third (its last prompt tokens, then output) is a source too
    again = warm.generate([other], GREEDY)[0]
    assert again.usage.cached_tokens == len(other) - 1 and again.token_ids == expected[1]
    assert len(other) - 1 < 48 and warm.stats().num_copied_tokens == 11 + (len(other) - 1) % 16
    off = make_engine(cache=replace(cache, partial_block_hits=False))
    off.generate([base], GREEDY)
    assert off.generate([other], GREEDY)[0].usage.cached_tokens == 16
    for engine in (warm, off):
        engine.check_integrity()
        assert engine.stats().kv_num_used_blocks == 0
