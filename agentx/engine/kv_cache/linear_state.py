"""The linear-state manager: recurrent states (linear attention, SSM) checkpointed in pool pages.

A request's list in this group has one entry per block of its tokens, mostly the null block.
Entry i, when it holds a page, holds the state after token (i + 1) * block_size (a checkpoint),
except the last entry, which holds the running state after every computed token::

    tokens   [ block 0 ][ block 1 ][ block 2 ][ block 3 ][ blo.. ]   num_computed = 4.5 blocks
    entries    null       page       null       null       page
                          ^ checkpoint at 2 blocks          ^ running state

A step over tokens n..n' reads the running page, writes a checkpoint into every page it crosses
and the running state into the last one. Which boundaries get a page is the retention policy's
plan (the KV policy's ``plan_checkpoints``, validated by its guard); a step whose checkpoints
do not fit the pool runs without them (the facade asks with ``keep_checkpoints=False``: then
only the running pages, the two per request ``get_max_num_blocks`` counts). Checkpoints are
published to the prefix cache once computed and then released: they stay hittable in the
pool's LRU until evicted, while the request keeps only its running page. A hit needs a
checkpoint exactly at the hit point (a hand-over instead carries the running page itself).
"""

from __future__ import annotations

from collections.abc import Sequence

from agentx.engine.block_hash import BlockHash
from agentx.engine.kv_cache.block_pool import BlockPool, KVBlock
from agentx.engine.kv_cache.policy import CheckpointPlan
from agentx.engine.kv_cache.policy_guard import KVPolicyGuard
from agentx.engine.kv_cache.retention import IntervalRetention, RetentionPolicy
from agentx.engine.kv_cache.single_type import (
    SingleTypeKVManager,
    _num_revived,
    register_manager,
)
from agentx.engine.kv_cache.specs import KVCacheSpec, LinearStateSpec
from agentx.engine.request import Request


class LinearStateManager(SingleTypeKVManager):
    def __init__(
        self,
        spec: KVCacheSpec,
        pool: BlockPool,
        group_id: int,
        retention: KVPolicyGuard | RetentionPolicy | None = None,
    ) -> None:
        super().__init__(spec, pool, group_id)
        self.retention = retention if retention is not None else IntervalRetention(0)
        self.plans: dict[str, CheckpointPlan] = {}
        # (entry index, pool key, rolling-only) written by a scheduled step, published once
        # the request's computed tokens reach that boundary
        self.pending: dict[str, list[tuple[int, BlockHash, bool]]] = {}
        self.rolling: dict[str, KVBlock] = {}  # the published rolling checkpoint
        self.last_checkpoint: dict[str, int] = {}  # deepest published boundary, in tokens

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVBlock]:
        for i in range(min(max_length // self.block_size, len(block_hashes)), 0, -1):
            block = self.get_cached(block_hashes[i - 1])
            if block is not None:
                return [self.pool.null_block] * (i - 1) + [block]
        return []

    def get_hit_block_indices(self, num_blocks: int) -> range:
        return range(num_blocks - 1, num_blocks)  # the checkpoint at the hit point only

    def get_exact_hit_entries(self, num_tokens: int) -> tuple[range, bool]:
        return range(0), True  # the running state after exactly num_tokens, nothing before

    def _plan(self, request: Request) -> CheckpointPlan:
        plan = self.plans.get(request.request_id)
        if plan is None:
            plan = self.retention.plan_checkpoints(request, self.block_size)
            self.plans[request.request_id] = plan
        return plan

    def _wanted(self, plan: CheckpointPlan, index: int, num_tokens: int, keep: bool) -> bool:
        """Whether entry ``index`` gets a page when the request grows to ``num_tokens``: the
        running state's always, a checkpoint's only with ``keep``."""
        last = -(-num_tokens // self.block_size) - 1
        if index == last or not keep:
            return index == last
        latest = num_tokens // self.block_size - 1
        return plan.keeps((index + 1) * self.block_size) or (plan.rolling and index == latest)

    def get_num_blocks_to_allocate(
        self,
        request: Request,
        num_tokens: int,
        new_computed_blocks: Sequence[KVBlock],
        keep_checkpoints: bool = True,
    ) -> int:
        plan = self._plan(request)
        start = len(self.req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        end = -(-num_tokens // self.block_size)
        wanted = (self._wanted(plan, i, num_tokens, keep_checkpoints) for i in range(start, end))
        return sum(wanted) + _num_revived(new_computed_blocks)

    def allocate_new_blocks(
        self, request: Request, num_tokens: int, keep_checkpoints: bool = True
    ) -> list[KVBlock]:
        plan = self._plan(request)
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        new_blocks = []
        for i in range(len(blocks), -(-num_tokens // self.block_size)):
            wanted = self._wanted(plan, i, num_tokens, keep_checkpoints)
            new_blocks.append(self.pool.allocate_blocks(1)[0] if wanted else self.pool.null_block)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Queue the checkpoints this step writes; they are published once computed."""
        rid = request.request_id
        plan = self._plan(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        num_done = self.num_cached_blocks.get(rid, 0)
        blocks = self.req_to_blocks[rid]
        pending = self.pending.setdefault(rid, [])
        for i in range(num_done, num_full):
            kept = plan.keeps((i + 1) * self.block_size)
            rolling = plan.rolling and i == num_full - 1
            if not blocks[i].is_null and (kept or rolling):
                pending.append((i, self.key(request.block_hashes[i]), not kept))
        self.num_cached_blocks[rid] = max(num_done, num_full)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        self._publish(request_id, num_computed_tokens)
        # every page before the running one is a published checkpoint or stale: release it
        last = -(-num_computed_tokens // self.block_size) - 1
        null = self.pool.null_block
        released = []
        for i in range(min(last, len(blocks))):
            if not blocks[i].is_null:
                released.append(blocks[i])
                blocks[i] = null
        self.pool.free_blocks(released)

    def _publish(self, request_id: str, num_computed_tokens: int) -> None:
        pending = self.pending.get(request_id)
        if not pending:
            return
        blocks = self.req_to_blocks[request_id]
        ready = [p for p in pending if (p[0] + 1) * self.block_size <= num_computed_tokens]
        self.pending[request_id] = [p for p in pending if p not in ready]
        for index, key, rolling_only in ready:
            block = blocks[index]
            self.pool.cache_block(block, key)
            boundary = (index + 1) * self.block_size
            self.last_checkpoint[request_id] = max(
                boundary, self.last_checkpoint.get(request_id, 0)
            )
            if rolling_only and block.block_hash == key:
                previous = self.rolling.get(request_id)
                if previous is not None and previous is not block:
                    self.pool.uncache_blocks([previous])  # superseded by a later boundary
                self.rolling[request_id] = block

    def get_num_useful_blocks(self, request_id: str) -> int | None:
        return self.last_checkpoint.get(request_id, 0) // self.block_size

    def _forget(self, request_id: str) -> None:
        self.plans.pop(request_id, None)
        self.pending.pop(request_id, None)
        self.rolling.pop(request_id, None)
        self.last_checkpoint.pop(request_id, None)

    def take(self, request_id: str) -> list[KVBlock]:
        self._forget(request_id)
        return super().take(request_id)

    def free(self, request_id: str, num_useful_blocks: int | None = None) -> None:
        self._forget(request_id)
        super().free(request_id, num_useful_blocks)

    def check_integrity(self) -> None:
        for rid, blocks in self.req_to_blocks.items():
            if blocks:
                assert not blocks[-1].is_null, f"{rid}: no running state page"
            for index, _, _ in self.pending.get(rid, ()):
                assert not blocks[index].is_null, f"{rid}: pending checkpoint {index} lost"


register_manager(LinearStateSpec, LinearStateManager)
