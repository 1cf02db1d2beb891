"""Exact-state tests of offload planning on hybrid KV layouts (no model, no tier): the one hit
length every group agrees on when a group's blocks may come from the device cache or a lower
tier, which pool keys a load fetches, and the held KV a finished load becomes."""

import torch

from agentx.engine.kv_cache import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheManager,
    LinearStateSpec,
    SlidingWindowSpec,
)
from agentx.engine.kv_cache.retention import IntervalRetention
from tests.helpers.kv import make_request

FULL = FullAttentionSpec(4, torch.float32, num_kv_heads=1, head_size=8)
SLIDING = SlidingWindowSpec(4, torch.float32, num_kv_heads=1, head_size=8, sliding_window=8)
LINEAR = LinearStateSpec(4, torch.float32, shapes=((2, 3), (16,)))
TOKENS = list(range(24))  # 6 blocks of 4


def hybrid_kv(num_blocks=40) -> KVCacheManager:
    """Full, sliding (window 8: a hit needs its last 2 blocks) and linear groups; linear
    checkpoints every 8 tokens (entries 1, 3, 5)."""
    groups = tuple(KVCacheGroup(spec, (i,)) for i, spec in enumerate([FULL, SLIDING, LINEAR]))
    layout = KVCacheLayout(num_blocks, groups, 256)
    return KVCacheManager(layout, retention=IntervalRetention(8))


def run_and_evict(kv):
    """Run 24 tokens, record every pool key published (the tiers store them all), then empty
    the device cache; returns the stored keys."""
    kv.enable_publish_log()
    first = make_request("a", TOKENS)
    kv.allocate_slots(first, 24, 0, kv.empty_blocks())
    first.num_computed_tokens = 24
    kv.free(first)
    stored = {key for key, _ in kv.take_published()}
    assert kv.reset_prefix_cache()
    kv.check_integrity()
    return stored


def keys_of(kv, hashes, entries):
    return [kv.coordinator.managers[g].key(hashes[i]) for i, g in entries]


def test_groups_publish_what_a_hit_needs_under_their_own_keys():
    kv = hybrid_kv()
    stored = run_and_evict(kv)
    hashes = make_request("x", TOKENS).block_hashes
    full = keys_of(kv, hashes, [(i, 0) for i in range(6)])
    sliding = keys_of(kv, hashes, [(i, 1) for i in range(6)])
    linear = keys_of(kv, hashes, [(1, 2), (3, 2), (5, 2)])  # the checkpoints only
    assert stored == set(full + sliding + linear)


def test_a_tier_hit_loads_every_group_to_one_agreed_length():
    kv = hybrid_kv()
    stored = run_and_evict(kv)
    request = make_request("b", TOKENS + [99])
    hashes = request.block_hashes

    def in_tiers(keys):
        return [k in stored for k in keys]

    hit = kv.plan_load(hashes, in_tiers)
    # 6 blocks: full 0..5, sliding 4..5 (the last window), linear 5 (the checkpoint at 24)
    entries = [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (4, 1), (5, 0), (5, 1), (5, 2)]
    assert hit.num_blocks == 6 and hit.device_blocks == []
    assert hit.keys == keys_of(kv, hashes, entries)
    # without the checkpoint at 24, every group falls back to the one at 16
    stored.discard(keys_of(kv, hashes, [(5, 2)])[0])
    hit = kv.plan_load(hashes, in_tiers)
    assert hit.num_blocks == 4
    assert hit.keys == keys_of(kv, hashes, [(0, 0), (1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)])
    # room for 6 fresh blocks only: 16 tokens would load 7, so the checkpoint at 8 (5 blocks)
    hit = kv.plan_load(hashes, in_tiers, num_reserved=39 - 6)
    assert hit.num_blocks == 2
    assert hit.keys == keys_of(kv, hashes, [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)])
    assert kv.plan_tier_only(hashes, in_tiers) == 4
    kv.check_integrity()  # planning touched nothing


def test_device_blocks_are_reused_and_a_loaded_hit_becomes_held_kv():
    kv = hybrid_kv()
    stored = run_and_evict(kv)
    request = make_request("b", TOKENS + [99])
    hashes = request.block_hashes
    # the device computed the first 8 tokens again: those blocks are reused, not loaded
    again = make_request("c", TOKENS[:9])
    kv.allocate_slots(again, 9, 0, kv.empty_blocks())
    again.num_computed_tokens = 9
    kv.free(again)
    kv.take_published()
    hit = kv.plan_load(hashes, lambda keys: [k in stored for k in keys])
    assert hit.num_blocks == 6
    device = keys_of(kv, hashes, [(0, 0), (1, 0)])
    assert [b.block_hash for b in hit.device_blocks] == device
    assert hit.keys == keys_of(kv, hashes, [(2, 0), (3, 0), (4, 0), (4, 1), (5, 0), (5, 1), (5, 2)])
    fresh = kv.prepare_load(hit.device_blocks, len(hit.keys))
    done = kv.complete_load(fresh, hit.keys, num_done=len(fresh))
    assert kv.take_published() == []  # loaded blocks are not stored back
    groups = kv.take_cached_hit(hashes)
    kv.free_blocks(hit.device_blocks + done)
    assert [len(g) for g in groups] == [6, 6, 6]
    assert [b.is_null for b in groups[1]] == [True] * 4 + [False] * 2
    assert [b.is_null for b in groups[2]] == [True] * 5 + [False]
    kv.add_held("h", TOKENS, groups)
    kv.check_integrity()
    request.held_kv = "h"
    blocks, num_hit = kv.get_computed_blocks(request)
    assert num_hit == 24 and blocks.held_kv == "h"
    kv.allocate_slots(request, 1, num_hit, blocks)
    request.num_computed_tokens = 25
    kv.free(request)
    kv.check_integrity()
    assert kv.num_free_blocks == 39


def test_a_load_failing_midway_keeps_the_longest_agreed_prefix():
    kv = hybrid_kv()
    stored = run_and_evict(kv)
    hashes = make_request("b", TOKENS + [99]).block_hashes
    hit = kv.plan_load(hashes, lambda keys: [k in stored for k in keys])
    fresh = kv.prepare_load(hit.device_blocks, len(hit.keys))
    # the first 8 pages landed (entries 0..5 of full, 4..5 of sliding): the last checkpoint not
    done = kv.complete_load(fresh, hit.keys, num_done=8)
    groups = kv.take_cached_hit(hashes)
    kv.free_blocks(hit.device_blocks + done)
    assert [len(g) for g in groups] == [0, 0, 0]  # no checkpoint before it was loaded either
    kv.check_integrity()
    assert kv.num_free_blocks == 39
