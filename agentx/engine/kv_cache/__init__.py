"""Paged KV cache: block pool, prefix cache, per-attention-type managers and their facade."""

from agentx.engine.block_hash import BlockHash, extend_block_hashes, hash_block
from agentx.engine.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVBlock
from agentx.engine.kv_cache.held import BlockCopy, HeldKV, HeldKVManager
from agentx.engine.kv_cache.manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from agentx.engine.kv_cache.policy import (
    CheckpointPlan,
    HeldCandidate,
    KVPolicy,
    LRUPolicy,
    ToolWait,
    ToolWaitDecision,
    TurnEnd,
    TurnEndDecision,
)
from agentx.engine.kv_cache.policy_guard import KVPolicyGuard
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
    "CheckpointPlan",
    "FreeBlockQueue",
    "FullAttentionSpec",
    "HeldCandidate",
    "HeldKV",
    "HeldKVManager",
    "KVBlock",
    "KVCacheBlocks",
    "KVCacheGroup",
    "KVCacheLayout",
    "KVCacheManager",
    "KVCacheSpec",
    "KVPolicy",
    "KVPolicyGuard",
    "LRUPolicy",
    "LinearStateSpec",
    "PrefixCacheStats",
    "SlidingWindowSpec",
    "ToolWait",
    "ToolWaitDecision",
    "TurnEnd",
    "TurnEndDecision",
    "extend_block_hashes",
    "hash_block",
]
