"""Paged KV cache: block pool, prefix cache, per-attention-type managers and their facade."""

from agentx.engine.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVBlock
from agentx.engine.kv_cache.hashing import BlockHash, extend_block_hashes, hash_block
from agentx.engine.kv_cache.held import BlockCopy, HeldKV, HeldKVManager
from agentx.engine.kv_cache.manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from agentx.engine.kv_cache.specs import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheSpec,
    LinearStateSpec,
    SlidingWindowSpec,
)

__all__ = [
    "AttentionSpec",
    "BlockCopy",
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "FullAttentionSpec",
    "HeldKV",
    "HeldKVManager",
    "KVBlock",
    "KVCacheBlocks",
    "KVCacheGroup",
    "KVCacheLayout",
    "KVCacheManager",
    "KVCacheSpec",
    "LinearStateSpec",
    "PrefixCacheStats",
    "SlidingWindowSpec",
    "extend_block_hashes",
    "hash_block",
]
