"""The KV cache manager: the facade the scheduler calls.

It answers in typed records (:class:`KVCacheBlocks`, one block list per KV group) and keeps the
prefix-cache statistics. It does not know how requests are ordered or what the model is.

    get_computed_blocks(request)          -> the prefix hit (no side effects)
    allocate_slots(request, n, hit)       -> the blocks for n more tokens, or None if they don't fit
    free(request)                         -> every block back to the pool (cached content kept)
    trim_slots(request)                   -> blocks past its computed tokens back (rejected drafts)
    hold(request)                         -> keep a finished request's blocks for the next turn
    finish_turn(request, hold)            -> hold or free a completed turn, as the KV policy says

A prefix hit comes from the prefix cache (full blocks, by hash) or, when the request names
held KV in ``held_kv``, from that held KV (every block, the partial tail too); the longer wins.
With ``partial_hits``, a cache hit goes on past its full blocks into the next one: the first
tokens of a cached block under the same parent that the prompt shares (block_pool.py) are
copied into the request's own block (``take_block_copies``: the engine runs the copies before
the step's forward) rather than computed again; prompts whose shared prefix ends mid-block
(text joined then tokenized, a chat turn after the last one's partial block) lose no tokens.

Every KV policy decision (policy.py) reaches the cache through ``self.policy``, the guard that
validates it before anything here applies it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from agentx.engine.block_hash import (
    BlockHash,
    extend_block_hashes,
    hash_partial_block,
    parent_key,
)
from agentx.engine.hints import BranchPoint, TurnsLeft
from agentx.engine.kv_cache.block_pool import KVBlock
from agentx.engine.kv_cache.coordinator import GroupBlocks, KVCacheCoordinator, TierHit
from agentx.engine.kv_cache.held import BlockCopy, HeldKV, HeldKVManager
from agentx.engine.kv_cache.policy import KVPolicy, TurnEnd
from agentx.engine.kv_cache.policy_guard import KVPolicyGuard
from agentx.engine.kv_cache.retention import IntervalRetention, RetentionPolicy
from agentx.engine.kv_cache.specs import KVCacheLayout
from agentx.engine.request import Request


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """Blocks per KV group, as handed between the KV manager and the scheduler."""

    blocks: GroupBlocks
    held_kv: str | None = None  # the blocks are this held KV's, moving to the request
    # a partial hit: the cached block whose first tokens the hit's last ones are copied from
    partial_src: KVBlock | None = None

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.blocks)


@dataclass(slots=True)
class PrefixCacheStats:
    num_queries: int = 0  # requests that looked up the cache
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_copied_tokens: int = 0  # of the hit tokens, those copied by partial hits
    num_dropped_checkpoints: int = 0  # planned linear checkpoints the pool had no room for


class KVCacheManager:
    def __init__(
        self,
        layout: KVCacheLayout,
        enable_caching: bool = True,
        retention: RetentionPolicy | None = None,
        policy: KVPolicy | None = None,
        policy_errors: str = "fallback",
        partial_hits: bool = False,
    ) -> None:
        """``policy`` makes the KV decisions (None: ``retention``, whose other hooks are the
        built-in ones); ``retention`` also plans checkpoints where the policy defers or fails
        (None: the rolling latest boundary). ``policy_errors``: see ``KVPolicyGuard``.
        ``partial_hits``: hits go on into a partly shared block (one full-attention group
        only; elsewhere hits stay whole blocks)."""
        self.layout = layout
        self.block_size = layout.block_size
        self.enable_caching = enable_caching
        fallback = retention if retention is not None else IntervalRetention(0)
        self.policy = KVPolicyGuard(
            policy if policy is not None else fallback, fallback, policy_errors
        )
        self.coordinator = KVCacheCoordinator(layout, enable_caching, self.policy)
        self.pool = self.coordinator.pool
        self.held = HeldKVManager(self.pool, self.block_size, self.policy)
        self.stats = PrefixCacheStats()
        self.partial_hits = partial_hits and self.coordinator.partial_hits
        self.coordinator.managers[0].partial_sources = self.partial_hits
        self._copies: list[BlockCopy] = []  # partial hits' copies for the step being scheduled
        if self.partial_hits:
            self.held.on_release = self._keep_held_tail

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_usage(self) -> float:
        return self.pool.get_usage()

    def empty_blocks(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.layout.groups))

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of the request, and its length in tokens; no side effects
        (``allocate_slots`` counts the query when the request takes the hit).

        The last token is always recomputed: its logits are needed to sample. A request that
        wants prompt logprobs takes no hit: a cached token has no logits.
        """
        if request.sampling.prompt_logprobs is not None:
            return self.empty_blocks(), 0
        max_length = request.num_tokens - 1
        hit, num_hit = self.empty_blocks(), 0
        if self.enable_caching:
            blocks, num_hit = self.coordinator.find_longest_cache_hit(
                request.block_hashes, max_length
            )
            hit = KVCacheBlocks(blocks)
            if self.partial_hits and num_hit < max_length:
                index = num_hit // self.block_size
                parent = parent_key(request.block_hashes, index, request.cache_salt)
                tokens = request.all_token_ids[num_hit : min(num_hit + self.block_size, max_length)]
                src, num_shared = self.pool.find_partial(parent, tokens)
                if src is not None:
                    hit = KVCacheBlocks(blocks, partial_src=src)
                    num_hit += num_shared
        held = self.held.get(request.held_kv)
        # held KV is another request's cache: a request of another salt never sees it (its
        # cached-token count would tell whether that context starts with a guessed prefix)
        if (
            held is not None
            and held.cache_salt == request.cache_salt
            and _is_prefix(held.token_ids, request.all_token_ids)
        ):
            num_held = min(held.num_tokens, max_length)
            # a linear state exists only at the held KV's end, not before it
            exact = not self.coordinator.has_linear or num_held == held.num_tokens
            if exact and num_held > 0 and num_held >= num_hit:
                num_blocks = -(-num_held // self.block_size)
                hit = KVCacheBlocks(tuple(g[:num_blocks] for g in held.blocks), held.handle)
                num_hit = num_held
        return hit, num_hit

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        reclaim_held: bool = True,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens after taking a prefix hit.

        Returns the newly allocated blocks, or None when the pool cannot hold them right now
        (linear-state checkpoints that do not fit are left out instead: ``_fit``);
        the request's own blocks are then unchanged, but unpinned held KV may have been
        released trying to make room and blocks that left a sliding window were freed. Blocks
        full once these tokens are computed are published to the prefix cache now: within one
        step every KV write happens before any attention read. A request taking a prefix hit
        (``new_computed_blocks`` given, even empty) counts as one prefix-cache query.
        ``reclaim_held=False`` never releases held KV to make room (slots for drafts).
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        computed = new_computed_blocks.blocks if new_computed_blocks else self.empty_blocks().blocks
        rid = request.request_id
        self.coordinator.remove_skipped_blocks(rid, request.num_computed_tokens)
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        keep = self._fit(request, num_total, computed, reclaim_held)
        if keep is None:
            return None
        self.coordinator.save_new_computed_blocks(rid, computed)
        if new_computed_blocks is not None and new_computed_blocks.held_kv is not None:
            self.held.release(new_computed_blocks.held_kv)  # its references moved to rid
        new_blocks = self.coordinator.allocate_new_blocks(request, num_total, keep)
        if new_computed_blocks is not None and new_computed_blocks.partial_src is not None:
            # the hit's partly shared block is the request's first new one: its shared tokens
            # come from the source, the rest are computed into it
            dst = new_blocks[0][0]
            self._copies.append(BlockCopy(new_computed_blocks.partial_src.block_id, dst.block_id))
            self.stats.num_copied_tokens += num_new_computed_tokens % self.block_size
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_total)
        if new_computed_blocks is not None:
            self.stats.num_queries += 1
            self.stats.num_query_tokens += request.num_tokens
            self.stats.num_hit_tokens += num_new_computed_tokens
        return KVCacheBlocks(new_blocks)

    def begin_step(self) -> None:
        """A step is being scheduled (blocks published from now on are no partial source yet:
        their KV is written by this step, after its copies run)."""
        self.pool.begin_step()

    def take_block_copies(self) -> list[BlockCopy]:
        """The partial hits' block copies since the last call, in order; the engine runs them
        before the step's forward (a copy may read a block a later one, or the forward, writes)."""
        copies, self._copies = self._copies, []
        return copies

    def _fit(
        self, request: Request, num_total: int, computed: GroupBlocks, reclaim_held: bool
    ) -> bool | None:
        """Whether the blocks for ``num_total`` tokens fit with the retention's checkpoints
        (True), only without them (False), or not at all (None). Held KV is released for the
        whole allocation first, as for any block; a checkpoint that still does not fit is not
        taken: it only makes a later hit possible, so it is worth neither waiting (a request
        alone in a small pool would wait forever) nor preempting anyone."""
        count = self.coordinator.get_num_blocks_to_allocate
        num_needed = count(request, num_total, computed)
        if num_needed <= self.pool.num_free_blocks:
            return True
        if reclaim_held:
            self.held.reclaim(num_needed, keep=request.held_kv)
            num_needed = count(request, num_total, computed)
            if num_needed <= self.pool.num_free_blocks:
                return True
        if not self.coordinator.has_linear:
            return None
        num_required = count(request, num_total, computed, keep_checkpoints=False)
        if num_required > self.pool.num_free_blocks:
            return None
        self.stats.num_dropped_checkpoints += num_needed - num_required
        return False

    def get_num_fitting_tokens(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> int:
        """The most of ``num_new_tokens`` whose blocks (checkpoints left out) fit the free
        pool now; no side effects. A request alone in the pool runs a chunk that small: a
        sliding window's blocks go back as it moves on, a whole prompt's need not fit at once."""
        computed = new_computed_blocks.blocks if new_computed_blocks else self.empty_blocks().blocks
        start = request.num_computed_tokens + num_new_computed_tokens
        count = self.coordinator.get_num_blocks_to_allocate
        low, high = 0, num_new_tokens
        while low < high:
            mid = (low + high + 1) // 2
            fits = count(request, start + mid, computed, keep_checkpoints=False)
            low, high = (mid, high) if fits <= self.pool.num_free_blocks else (low, mid - 1)
        return low

    def free(self, request: Request) -> None:
        rid, num_computed = request.request_id, request.num_computed_tokens
        self.coordinator.remove_skipped_blocks(rid, num_computed)
        # a request preempted in the step that scheduled it published blocks it never computed
        self.coordinator.uncache_uncomputed(rid, num_computed)
        if self.partial_hits and num_computed % self.block_size:
            computed = request.all_token_ids[:num_computed]
            blocks = self.coordinator.get_blocks(rid)[0]
            self._keep_tail(blocks, computed, request.block_hashes, request.cache_salt)
        self.coordinator.free(rid)

    def _keep_held_tail(self, held: HeldKV) -> None:
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, held.token_ids, self.block_size, held.cache_salt)
        self._keep_tail(held.blocks[0], held.token_ids, hashes, held.cache_salt)

    def _keep_tail(
        self,
        blocks: list[KVBlock],
        token_ids: list[int],
        block_hashes: list[BlockHash],
        cache_salt: bytes,
    ) -> None:
        """The partial last block of ``token_ids`` (a sequence's computed tokens, ``blocks``
        its blocks, ``block_hashes`` its full blocks' hashes), about to be freed, stays a
        partial-hit source, cached under a key of its tokens (evicted as any cached block is),
        when nobody else holds it: a later prompt that repeats these tokens (the next chat
        turn) copies them."""
        index, num_tail = divmod(len(token_ids), self.block_size)
        if num_tail == 0 or index >= len(blocks):
            return
        block = blocks[index]
        if block.is_null or block.ref_cnt != 1 or block.block_hash is not None:
            return
        tokens = tuple(token_ids[index * self.block_size :])
        parent = parent_key(block_hashes, index, cache_salt)
        key = hash_partial_block(parent, tokens, cache_salt)
        self.pool.cache_block(block, key, parent, tokens, publish=False)

    def trim_slots(self, request: Request) -> int:
        """Release the blocks past the request's computed tokens: the slots of drafts that
        verification rejected (their KV was written but is never read: the next tokens
        overwrite those slots). Only computed real tokens were ever published (a block's hash
        needs its tokens), so the prefix cache keeps exactly the accepted content. Returns the
        number of blocks released."""
        if self.coordinator.has_linear:
            return 0
        return self.coordinator.trim(request.request_id, request.num_computed_tokens)

    def hold(self, request: Request) -> None:
        """Hold a finished request's KV under its id for a request that names it in ``held_kv``.
        Its hints act on the hold: ``BranchPoint(n)`` keeps it until n forks were made,
        ``TurnsLeft(k)`` orders its release under pressure (held.py)."""
        self.trim_slots(request)
        self.coordinator.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        blocks = self.coordinator.take(request.request_id)
        tokens = request.all_token_ids[: request.num_computed_tokens]
        num_forks, turns_left = 0, None
        for hint in request.hints:  # the last of each kind wins, as the session sent them
            if isinstance(hint, BranchPoint):
                num_forks = hint.num_forks
            elif isinstance(hint, TurnsLeft):
                turns_left = hint.num_turns
        self.held.add(
            request.request_id,
            tokens,
            blocks,
            request.cache_salt,
            num_forks=num_forks,
            turns_left=turns_left,
        )

    def finish_turn(self, request: Request, hold: bool) -> None:
        """A completed turn: ask the policy (``on_turn_end``), then hold or free its KV and
        apply the validated decision: soft-pin its first full blocks, demote the rest (a held
        turn is then released to the prefix cache)."""
        rid, num_computed = request.request_id, request.num_computed_tokens
        num_full = min(num_computed // self.block_size, len(request.block_hashes))
        turn = TurnEnd(
            rid,
            num_computed,
            request.num_prompt_tokens,
            num_full,
            self.block_size,
            tuple(request.block_hashes[:num_full]),
            hold,
            tuple(request.hints),
        )
        decision = self.policy.on_turn_end(turn)
        n = decision.soft_pin_blocks
        groups = self.coordinator.get_blocks(rid)
        pinned = [b for g in groups for b in reversed(g[:n])]  # the prefix is evicted last
        rest = [b for g in groups for b in g[n:num_full]]
        if hold:
            self.hold(request)
        else:
            self.free(request)
        self.pool.soft_pin(pinned)
        if decision.demote:
            if hold:
                self.held.release(rid)
            self.pool.demote_blocks(rest)

    def fork_held(self, handle: str, new_handles: list[str]) -> list[BlockCopy] | None:
        """Copy-on-write forks of held KV; the caller runs the returned block copies
        before any request uses the new handles. None when the handle is unknown or the pool
        has no room for the tail copies (other unpinned held KV may have been released trying
        to make room)."""
        if handle not in self.held:
            return None
        copies = self.held.fork(handle, new_handles)
        if copies is None:
            self.held.reclaim(len(new_handles) * len(self.layout.groups), keep=handle)
            copies = self.held.fork(handle, new_handles)
        return copies

    def release_held(self, handle: str, drop_cached: bool = False) -> bool:
        return self.held.release(handle, drop_cached)

    def pin_held(self, handle: str, pinned: bool = True) -> bool:
        return self.held.set_pinned(handle, pinned)

    def get_held(self, handle: str | None) -> HeldKV | None:
        return self.held.get(handle)

    # ---- for the offload tiers (offload/manager.py); every layout ---------------------------

    def enable_publish_log(self) -> None:
        """From now on, record every block published to the prefix cache (``take_published``):
        pool keys of every group (full blocks, sliding-window blocks, linear checkpoints)."""
        self.pool.published = []

    def take_published(self) -> list[tuple[BlockHash, KVBlock]]:
        """Drain the (pool key, block) pairs published since the last call, still cached."""
        return self.pool.take_published()

    def plan_load(
        self,
        block_hashes: list[BlockHash],
        in_tiers: Callable[[list[BlockHash]], list[bool]],
        num_reserved: int = 0,
    ) -> TierHit:
        """The longest prefix hit of ``block_hashes`` the device and the tiers complete in
        every group (the coordinator's rule), whose fresh blocks fit the pool now with
        ``num_reserved`` to spare; no side effects."""
        num_free = self.pool.num_free_blocks - num_reserved
        return self.coordinator.plan_tier_hit(block_hashes, in_tiers, num_free)

    def plan_tier_only(
        self, block_hashes: list[BlockHash], in_tiers: Callable[[list[BlockHash]], list[bool]]
    ) -> int:
        """Blocks of the longest prefix hit the tiers alone complete (an export's length)."""
        return self.coordinator.plan_tier_hit(block_hashes, in_tiers, use_device=False).num_blocks

    def plan_exact_load(
        self,
        block_hashes: list[BlockHash],
        num_tokens: int,
        tail_key: BlockHash,
        in_tiers: Callable[[list[BlockHash]], list[bool]],
        use_device: bool = True,
    ) -> TierHit | None:
        """The hit of exactly ``num_tokens`` tokens a hand-over resumes at (full blocks and
        each group's tail page under ``tail_key``), if the device and the tiers hold all of it
        and its fresh blocks fit the pool now; ``use_device=False``: the tiers alone (an
        export). No side effects."""
        num_free = self.pool.num_free_blocks if use_device else None
        return self.coordinator.plan_exact_hit(
            block_hashes, num_tokens, tail_key, in_tiers, num_free, use_device
        )

    def take_exact_hit(
        self, block_hashes: list[BlockHash], num_tokens: int, tails: list[KVBlock]
    ) -> GroupBlocks | None:
        """After an exact load: the hit's blocks, every group, referenced (``tails``' own
        references move in); None when a full block is missing from the device cache."""
        return self.coordinator.take_exact_hit(block_hashes, num_tokens, tails)

    def get_held_tails(self, handle: str, tail_key: BlockHash) -> list[tuple[BlockHash, KVBlock]]:
        """(pool key, block) of the pages held KV hands over besides its full blocks: each
        group's partial last block or linear state, under the group's key of ``tail_key``."""
        held = self.held.get(handle)
        if held is None:
            return []
        tails = self.coordinator.get_tail_blocks(held.blocks, held.num_tokens)
        return [(self.coordinator.managers[g].key(tail_key), b) for g, b in tails]

    def get_tail_keys(self, tail_key: BlockHash) -> list[BlockHash]:
        """Every group's key of a hand-over's ``tail_key`` (to drop them from the tiers)."""
        return [m.key(tail_key) for m in self.coordinator.managers]

    def get_num_loadable_blocks(self, prefix: list[KVBlock]) -> int:
        """How many fresh blocks ``prepare_load(prefix, n)`` can allocate right now."""
        return self.pool.num_free_blocks - sum(1 for b in prefix if b.ref_cnt == 0)

    def prepare_load(self, prefix: list[KVBlock], num_blocks: int) -> list[KVBlock]:
        """Reference the device blocks a hit reuses and allocate ``num_blocks`` fresh blocks
        for the pages it loads; ``complete_load`` gives them their pool keys."""
        self.pool.touch(prefix)
        return self.pool.allocate_blocks(num_blocks)

    def complete_load(
        self, blocks: list[KVBlock], keys: list[BlockHash], num_done: int
    ) -> list[KVBlock]:
        """The first ``num_done`` blocks hold their pages now: cache them under their pool
        keys (not published: the tiers have them); the rest failed and go back to the pool.
        Returns the done blocks."""
        done, failed = blocks[:num_done], blocks[num_done:]
        log, self.pool.published = self.pool.published, None
        for block, key in zip(done, keys, strict=False):
            self.pool.cache_block(block, key)
        self.pool.published = log
        self.pool.free_blocks(failed)
        return done

    def take_cached_hit(self, block_hashes: list[BlockHash]) -> GroupBlocks:
        """Reference and return the device blocks of the longest hit of ``block_hashes`` every
        group agrees on (after a load: what landed of it); empty lists when none."""
        max_length = len(block_hashes) * self.block_size
        groups, _ = self.coordinator.find_longest_cache_hit(block_hashes, max_length)
        for group in groups:
            self.pool.touch(group)
        return groups

    def get_held_keys(self, handle: str) -> list[BlockHash]:
        """The pool keys of held KV's cached blocks, every group (what the tiers hold of it)."""
        held = self.held.get(handle)
        if held is None:
            return []
        return [b.block_hash for g in held.blocks for b in g if b.block_hash is not None]

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop a reference from each block, last block first: the tail is evicted first."""
        self.pool.free_blocks(reversed(blocks))

    def demote_cached(self, block_hashes: list[BlockHash]) -> None:
        """Free cached blocks of these hashes are reused before other cached ones (a lower
        tier keeps their content); held blocks are skipped."""
        keys = [m.key(h) for h in block_hashes for m in self.coordinator.managers]
        blocks = [self.pool.get_cached_block(k) for k in keys]
        self.pool.demote_blocks([b for b in blocks if b is not None])

    def add_held(
        self, handle: str, token_ids: list[int], blocks: GroupBlocks, cache_salt: bytes = b""
    ) -> None:
        """Hold ``blocks`` (their references move in) as the KV of ``token_ids``."""
        self.held.add(handle, token_ids, blocks, cache_salt)

    def expect_return(self, handle: str, at: float) -> None:
        """Held KV whose session is back at ``at``: under pressure, the one expected back last
        is released first."""
        self.held.expected_return[handle] = at

    # ---- introspection -----------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def get_max_num_blocks(self, max_model_len: int) -> int:
        return self.coordinator.get_max_num_blocks(max_model_len)

    def check_integrity(self, other_refs: Iterable[KVBlock] = ()) -> None:
        """Pool invariants, plus: each block's ref count equals the number of its holders
        (requests, held KV, and ``other_refs``: references taken outside both, once each, such
        as an offload load in flight)."""
        self.pool.check_integrity()
        self.coordinator.check_integrity()
        self.held.check_integrity()
        holders: dict[int, int] = {}
        for block in other_refs:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for m in self.coordinator.managers:
            for blocks in m.req_to_blocks.values():
                for block in blocks:
                    if not block.is_null:
                        holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.held.iter_blocks():
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for held in self.held:
            num_blocks = -(-held.num_tokens // self.block_size)
            assert all(len(g) == num_blocks for g in held.blocks), f"{held.handle}: block count"
        for block in self.pool.blocks[1:]:
            expected = holders.get(block.block_id, 0)
            assert block.ref_cnt == expected, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {expected} requests"
            )
        used = sum(1 for b in self.pool.blocks[1:] if b.ref_cnt > 0)
        assert used + self.pool.num_free_blocks == self.pool.num_blocks - 1, "blocks leaked"

    def get_num_used_blocks(self) -> int:
        return self.pool.num_blocks - 1 - self.pool.num_free_blocks


def _is_prefix(prefix: list[int], tokens: list[int]) -> bool:
    return len(prefix) <= len(tokens) and tokens[: len(prefix)] == prefix


__all__ = ["KVBlock", "KVCacheBlocks", "KVCacheManager", "PrefixCacheStats"]
