"""Builders shared by the KV-cache and scheduler tests (no model involved)."""

import torch

from agentx.engine.kv_cache import FullAttentionSpec, KVCacheGroup, KVCacheLayout, KVCacheManager
from agentx.engine.request import Request
from agentx.engine.sampling import SamplingParams

BLOCK_SIZE = 4


def make_manager(num_blocks: int, caching: bool = True) -> KVCacheManager:
    spec = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)
    layout = KVCacheLayout(num_blocks, (KVCacheGroup(spec, (0,)),))
    return KVCacheManager(layout, enable_caching=caching)


def make_request(rid: str, token_ids: list[int], max_tokens: int = 8, **kw) -> Request:
    return Request(
        rid,
        list(token_ids),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        block_size=BLOCK_SIZE,
        **kw,
    )
