"""Exact-state tests of the hybrid KV cache: sliding-window freeing, linear-state checkpoints,
the coordinator's one hit length across groups, and the retention policies (no model)."""

import pytest
import torch

from agentx.engine.kv_cache import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheManager,
    LinearStateSpec,
    SlidingWindowSpec,
)
from agentx.engine.kv_cache.retention import (
    IntervalRetention,
    MarconiRetention,
    NoRetention,
    make_retention,
)
from tests.helpers.kv import make_request

FULL = FullAttentionSpec(4, torch.float32, num_kv_heads=1, head_size=8)
SLIDING = SlidingWindowSpec(4, torch.float32, num_kv_heads=1, head_size=8, sliding_window=8)
LINEAR = LinearStateSpec(4, torch.float32, shapes=((2, 3), (16,)))


def make_kv(specs, num_blocks=40, retention=None) -> KVCacheManager:
    groups = tuple(KVCacheGroup(spec, (i,)) for i, spec in enumerate(specs))
    return KVCacheManager(KVCacheLayout(num_blocks, groups, 256), retention=retention)


def admit(kv, request, num_new=None):
    """Schedule a waiting request as the scheduler does; returns (hit tokens, new block ids)."""
    hit, num_hit = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit if num_new is None else num_new
    new = kv.allocate_slots(request, num_new, num_hit, hit)
    request.num_computed_tokens = num_hit + num_new
    kv.check_integrity()
    return num_hit, new.get_block_ids()


def decode(kv, request, token_id):
    request.append_output_token(token_id)
    new = kv.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    kv.check_integrity()
    return new.get_block_ids()


def test_layout_needs_one_block_size_and_a_big_enough_page():
    other = FullAttentionSpec(8, torch.float32, num_kv_heads=1, head_size=8)
    with pytest.raises(ValueError, match="one block size"):
        KVCacheLayout(8, (KVCacheGroup(FULL, (0,)), KVCacheGroup(other, (1,))), 512)
    with pytest.raises(ValueError, match="larger than the pool's page"):
        KVCacheLayout(8, (KVCacheGroup(FULL, (0,)),), 64)
    assert SLIDING.get_max_num_blocks(10_000) == 4  # W-1 = 7 tokens straddle 3 blocks, +1
    assert LINEAR.page_size_bytes == (6 + 16) * 4


def test_sliding_window_returns_blocks_that_left_the_window_while_running():
    kv = make_kv([FULL, SLIDING])
    request = make_request("a", list(range(20)), max_tokens=16)
    assert admit(kv, request) == (0, ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]))
    # the next query (position 20) sees 13..20: blocks 0-2 (tokens 0..11) leave the window
    assert decode(kv, request, 100) == ([11], [12])
    assert kv.get_block_ids("a") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12])
    for token in range(101, 105):
        decode(kv, request, token)
    # position 24 sees 17..24: block 3 (12..15) is out too; the window's memory stays bounded
    assert kv.get_block_ids("a")[1] == [0, 0, 0, 0, 10, 12, 14]
    held = [b for b in kv.get_block_ids("a")[1] if b]
    assert len(held) <= SLIDING.get_max_num_blocks(10_000)
    kv.free(request)
    kv.check_integrity()
    assert kv.num_free_blocks == 39


def test_sliding_window_hit_needs_only_the_last_window():
    kv = make_kv([SLIDING], num_blocks=12)
    first = make_request("a", list(range(24)))
    admit(kv, first)
    kv.free(first)
    # forget the first block (tokens 0..3): a sliding hit at 24 does not need it
    kv.pool.uncache_blocks([kv.pool.blocks[1]])
    again = make_request("b", list(range(24)) + [99])
    num_hit, _ = admit(kv, again)
    assert num_hit == 24
    assert kv.get_block_ids("b")[0][:6] == [0, 0, 0, 0, 5, 6]  # only the window is revived
    # a gap inside the last window forbids the hit there; the run before it still serves
    kv.free(again)
    kv.pool.uncache_blocks([kv.pool.blocks[5]])  # tokens 16..19
    third = make_request("c", list(range(24)) + [98])
    assert admit(kv, third)[0] == 16  # blocks 2, 3 (tokens 8..15) are the window before 16
    assert kv.get_block_ids("c")[0][:4] == [0, 0, 3, 4]


def test_full_and_sliding_groups_agree_on_one_hit_length():
    kv = make_kv([FULL, SLIDING])
    first = make_request("a", list(range(16)))
    admit(kv, first)
    kv.free(first)
    kv.pool.uncache_blocks([kv.pool.blocks[8]])  # sliding group's block for tokens 12..15
    second = make_request("b", list(range(16)) + [7])
    num_hit, _ = admit(kv, second)
    assert num_hit == 12  # full attention alone would give 16; sliding narrows it to 12
    # the uncached block 8 went to the front of the free queue and is reused first
    assert kv.get_block_ids("b") == ([1, 2, 3, 8, 9], [0, 6, 7, 10, 11])
    assert second.num_computed_tokens == 17


def test_linear_state_checkpoints_only_planned_boundaries():
    kv = make_kv([FULL, LINEAR], retention=IntervalRetention(4))
    request = make_request("a", list(range(10)), max_tokens=8)
    # entries 0, 1: checkpoints after 4 and 8 tokens; entry 2: the running state
    assert admit(kv, request) == (0, ([1, 2, 3], [4, 5, 6]))
    decode(kv, request, 100)
    # once computed, checkpoints are published and released; the request keeps its running page
    assert kv.get_block_ids("a") == ([1, 2, 3], [0, 0, 6])
    assert kv.pool.blocks[4].ref_cnt == 0 and kv.pool.blocks[4].block_hash is not None
    other = make_request("b", list(range(8)) + [50, 51, 52])
    assert admit(kv, other) == (8, ([7], [8]))
    assert kv.get_block_ids("b") == ([1, 2, 7], [0, 5, 8])
    assert kv.pool.blocks[5].ref_cnt == 1  # the checkpoint is the new request's source state


def test_linear_hit_needs_a_checkpoint_exactly_at_the_hit_point():
    kv = make_kv([FULL, LINEAR], retention=IntervalRetention(0))  # rolling latest only
    first = make_request("a", list(range(10)))
    admit(kv, first)  # the latest boundary reached is 8
    kv.free(first)
    assert admit(kv, make_request("b", list(range(9)) + [7]))[0] == 8
    # sharing only the first 4 tokens: full attention has them, the linear state does not
    assert admit(kv, make_request("c", list(range(4)) + [9, 9, 9]))[0] == 0


def test_rolling_checkpoint_replaces_the_previous_one():
    kv = make_kv([FULL, LINEAR], retention=IntervalRetention(0))
    request = make_request("a", list(range(5)), max_tokens=8)
    admit(kv, request)
    decode(kv, request, 100)  # publishes the checkpoint at 4
    ckpt4 = kv.pool.get_cached_block(kv.coordinator.managers[1].key(request.block_hashes[0]))
    assert ckpt4 is not None
    for token in (101, 102, 103, 104):
        decode(kv, request, token)  # reaches 9 computed: the checkpoint at 8 is published
    key8 = kv.coordinator.managers[1].key(request.block_hashes[1])
    assert kv.pool.get_cached_block(key8) is not None
    # superseded: uncached and put first in line, so the next block allocated (the full
    # group's block for tokens 8..11) reused it
    assert ckpt4.block_hash is None
    assert kv.get_block_ids("a") == ([1, 2, 3], [0, 0, 5])
    assert ckpt4.block_id == 3


def test_no_retention_gives_no_linear_hits():
    kv = make_kv([FULL, LINEAR], retention=NoRetention())
    first = make_request("a", list(range(12)))
    admit(kv, first)
    kv.free(first)
    assert admit(kv, make_request("b", list(range(12)) + [1]))[0] == 0


def test_marconi_checkpoints_a_shared_prefix_the_second_time_it_is_seen():
    kv = make_kv([FULL, LINEAR], retention=MarconiRetention())
    shared = list(range(8))
    first = make_request("a", shared + [20, 21, 22, 23, 24])  # 13 tokens: rolling ckpt at 12
    admit(kv, first)
    kv.free(first)
    second = make_request("b", shared + [30, 31, 32])
    assert admit(kv, second)[0] == 0  # first sight of the branch point: nothing to resume
    decode(kv, second, 5)
    kv.free(second)
    third = make_request("c", shared + [40, 41, 42, 43])
    assert admit(kv, third)[0] == 8  # the second request checkpointed the branch point at 8


def test_hybrid_free_sends_blocks_past_the_last_checkpoint_to_the_front():
    kv = make_kv([FULL, LINEAR], retention=IntervalRetention(8))
    request = make_request("a", list(range(14)))
    admit(kv, request)  # checkpoint at 8 (interval and prompt end 12)
    decode(kv, request, 1)
    kv.free(request)
    kv.check_integrity()
    full_blocks = [1, 2, 3, 4]
    queue = kv.pool.free_queue.get_block_ids()
    # full-attention blocks past 12 tokens can be part of no hit: first in line for reuse
    assert queue.index(full_blocks[3]) < queue.index(full_blocks[0])
    assert queue[:2] == [7, 4]  # the running state page (unpublished), the block past 12


def test_make_retention_rejects_unknown_names_and_bad_intervals():
    with pytest.raises(ValueError, match="unknown retention policy"):
        make_retention("lru")
    with pytest.raises(ValueError, match=">= 0"):
        IntervalRetention(-1)


def test_checkpoints_the_pool_cannot_hold_are_left_out_not_waited_for():
    # 24 prompt + 4 output tokens: 7 full blocks and 2 linear pages, all 9 of the pool; interval
    # retention plans a checkpoint at every boundary, 5 more pages than the prefill has room for
    kv = make_kv([FULL, LINEAR], num_blocks=10, retention=IntervalRetention(4))
    assert kv.get_max_num_blocks(28) == 9
    request = make_request("a", list(range(24)), max_tokens=4)
    # the prefill runs with the running page only (it is also the checkpoint at 24)
    assert admit(kv, request) == (0, ([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 7]))
    assert kv.stats.num_dropped_checkpoints == 5
    assert decode(kv, request, 100) == ([8], [9])  # room again: nothing dropped
    assert kv.stats.num_dropped_checkpoints == 5
    assert kv.get_block_ids("a") == ([1, 2, 3, 4, 5, 6, 8], [0, 0, 0, 0, 0, 7, 9])
    kv.free(request)
    kv.check_integrity()
    # what was kept is a hit: the checkpoint at 24; none before it
    assert admit(kv, make_request("b", list(range(24)) + [7, 7]))[0] == 24
    assert kv.get_computed_blocks(make_request("c", list(range(20)) + [7]))[1] == 0


def test_a_step_that_does_not_fit_even_without_checkpoints_still_waits():
    kv = make_kv([FULL, LINEAR], num_blocks=7, retention=IntervalRetention(4))
    request = make_request("a", list(range(24)))
    hit, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, 24, num_hit, hit) is None  # 6 + 1 of 6 free: no
    assert kv.stats.num_dropped_checkpoints == 0 and kv.get_num_used_blocks() == 0
    kv.check_integrity()
