"""Builders shared by the KV-cache and scheduler tests (no model involved)."""

import torch

from agentx.engine.kv_cache import FullAttentionSpec, KVCacheGroup, KVCacheLayout, KVCacheManager
from agentx.engine.request import Request, RequestStatus
from agentx.engine.sampling import SamplingParams

BLOCK_SIZE = 4
FULL = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)


def make_manager(num_blocks: int, caching: bool = True, partial_hits: bool = False):
    layout = KVCacheLayout(num_blocks, (KVCacheGroup(FULL, (0,)),))
    return KVCacheManager(layout, enable_caching=caching, partial_hits=partial_hits)


def make_request(rid: str, token_ids: list[int], max_tokens: int = 8, **kw) -> Request:
    return Request(
        rid,
        list(token_ids),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        block_size=BLOCK_SIZE,
        **kw,
    )


def make_kv(num_blocks=9, policy=None, errors="raise", specs=(FULL,), retention=None):
    groups = tuple(KVCacheGroup(spec, (i,)) for i, spec in enumerate(specs))
    layout = KVCacheLayout(num_blocks, groups, 256)
    return KVCacheManager(layout, retention=retention, policy=policy, policy_errors=errors)


def run_turn(kv, rid, tokens, hold=False, end=True, **kw):
    """Compute a request's prompt, sample one token (never computed) and end the turn."""
    r = make_request(rid, tokens, hold_kv=hold, **kw)
    hit, n = kv.get_computed_blocks(r)
    kv.allocate_slots(r, len(tokens) - n, n, hit)
    r.num_computed_tokens = len(tokens)
    r.append_output_token(100)
    r.status = RequestStatus.FINISHED_STOPPED
    if end:
        kv.finish_turn(r, hold=hold)
        kv.check_integrity()
    return r


def assert_no_leak(kv):
    for held in list(kv.held):
        kv.release_held(held.handle)
    kv.check_integrity()
    assert kv.get_num_used_blocks() == 0
