"""Exact-state tests of offload planning on hybrid KV layouts (no model): the one hit length
every group agrees on when a group's blocks may come from the device cache or a lower tier,
which pool keys a load fetches, and the held KV a finished load becomes; then a hand-over
between two offload managers sharing a host tier, which resumes at the exact token in every
group (each group's partial block, the linear state itself), page for page."""

import pytest
import torch

from agentx.config import OffloadConfig
from agentx.engine.kv_cache import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheManager,
    LinearStateSpec,
    SlidingWindowSpec,
)
from agentx.engine.kv_cache.retention import IntervalRetention
from agentx.engine.offload.host import HostTier
from agentx.engine.offload.manager import OffloadManager
from agentx.engine.offload.tiered import TieredStore
from agentx.engine.request import RequestStatus
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


# ---- a hand-over: export with its tail, import on another engine ----------------------------


class Pages:
    """A device whose page ``b`` holds the bytes ``offset + b``: every block's content tells
    which engine and block it was written on."""

    page_bytes = 8

    def __init__(self, num_blocks: int, offset: int) -> None:
        self.data = (torch.arange(num_blocks, dtype=torch.uint8) + offset)[:, None].repeat(1, 8)

    def gather_pages(self, block_ids):
        return self.data[block_ids].clone()

    def scatter_pages(self, block_ids, pages):
        self.data[block_ids] = pages


@pytest.fixture
def pair():
    """Offload managers of a prefilling (P) and a decoding (D) engine sharing a host tier."""
    tier = HostTier(Pages.page_bytes, 64)
    config = OffloadConfig(host_bytes=64 * Pages.page_bytes)
    managers = [
        OffloadManager(TieredStore([tier]), hybrid_kv(), Pages(40, offset), config)
        for offset in (0, 100)
    ]
    yield managers
    for manager in managers:
        manager.flush()
        manager.store.worker.close()


def prefill_and_hold(offload, tokens, num_prompt=14):
    """P prefills ``num_prompt`` tokens, decodes the rest of ``tokens`` and one more, and holds
    the KV of ``tokens``; its blocks reach the tier. Linear checkpoints sit at 8, 12 (the
    prompt end) and 16: none at 20, where every group of a tailless hit used to stop."""
    kv = offload.kv
    request = make_request("a", tokens[:num_prompt], hold_kv=True)
    kv.allocate_slots(request, num_prompt, 0, kv.empty_blocks())
    request.num_computed_tokens = num_prompt
    for token_id in tokens[num_prompt:]:
        request.append_output_token(token_id)
        kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
    request.append_output_token(100)
    request.status = RequestStatus.FINISHED_LENGTH
    kv.finish_turn(request, hold=True)
    offload.after_step()
    kv.check_integrity()
    return kv.get_held("a")


def contents(offload, groups):
    """Per group, the first byte of each entry's page (None: the null block)."""
    data = offload.runner.data
    return [[None if b.is_null else int(data[b.block_id, 0]) for b in g] for g in groups]


@pytest.mark.parametrize(
    ("num_tokens", "tail_groups", "pattern"),
    [
        # 5 blocks + 2 tokens: every group ends in a partial block; sliding (window 8) reads
        # blocks 3 and 4 before it, linear only its running state
        (22, [0, 1, 2], [[1] * 6, [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 1]]),
        # 5 whole blocks: attention groups need no tail; the linear state after 20 tokens is no
        # checkpoint, so its running page goes over (it would even if it were one)
        (20, [2], [[1] * 5, [0, 0, 0, 1, 1], [0, 0, 0, 0, 1]]),
    ],
)
def test_a_hand_over_resumes_at_the_exact_token_in_every_group(
    pair, num_tokens, tail_groups, pattern
):
    p, d = pair
    held = prefill_and_hold(p, TOKENS[:num_tokens])
    export = p.export("a", include_tail=True)
    num_full = num_tokens // 4
    assert export.num_tokens == num_tokens  # was 16: a hybrid stopped at a checkpoint
    assert export.token_ids == tuple(TOKENS[: num_full * 4])
    assert export.tail_token_ids == tuple(TOKENS[num_full * 4 : num_tokens])
    tail_keys = [p.kv.coordinator.managers[g].key(export.tail_key) for g in tail_groups]
    assert p.store.contains(tail_keys) == [True] * len(tail_keys)
    assert d.import_(export, "h") == num_tokens
    imported = d.kv.get_held("h")
    assert imported.token_ids == TOKENS[:num_tokens]
    # the entries P holds, each page a copy of P's (P's pages hold their block ids, D's
    # fresh ones 100 + theirs)
    for groups in (held.blocks, imported.blocks):
        assert [[int(not b.is_null) for b in g] for g in groups] == pattern
    assert contents(d, imported.blocks) == contents(p, held.blocks)
    assert d.counters.num_loaded_blocks == sum(map(sum, pattern))
    assert d.store.contains(tail_keys) == [False] * len(tail_keys)  # one hand-over's keys
    # D's next request takes the whole held KV as its hit, the partial block included
    request = make_request("b", TOKENS[:num_tokens] + [100], held_kv="h")
    assert d.kv.get_computed_blocks(request)[1] == num_tokens
    for offload, handle in ((p, "a"), (d, "h")):
        assert offload.kv.release_held(handle)
        offload.check_integrity()
        offload.kv.check_integrity()
        assert offload.kv.get_num_used_blocks() == 0


def test_a_hand_over_whose_block_left_the_tier_resumes_where_every_group_agrees(pair):
    p, d = pair
    prefill_and_hold(p, TOKENS[:22])
    export = p.export("a", include_tail=True)
    p.store.drop([export.block_hashes[4]])  # the full group's block 4, evicted meanwhile
    # full 0..3, sliding 2..3 and the linear checkpoint at 16: the longest agreed prefix
    assert d.import_(export, "h") == 16
    assert d.counters.num_loaded_blocks == 4 + 2 + 1
    tail_keys = d.kv.get_tail_keys(export.tail_key)
    assert d.store.contains(tail_keys) == [False] * 3
    for offload, handle in ((p, "a"), (d, "h")):
        assert offload.kv.release_held(handle)
        offload.kv.check_integrity()
        assert offload.kv.get_num_used_blocks() == 0
