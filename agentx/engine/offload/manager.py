"""The offload manager: drives the tiered store from the engine step (engine thread only).

    store     blocks published on the device during a step are gathered after it (their KV is
              written then) and written through to every tier, one batched job per step
    load      a new request whose prefix continues in a tier is parked (out of line, others
              run); its blocks load into fresh device blocks, become held KV the request
              extends, and it goes back in line: it neither recomputes them nor stalls anyone
    hints     a held session with a tool latency is released first under pressure (its blocks
              live on in the tiers) and prefetched back ``prefetch_margin_s`` before it returns
              (the KV policy's ``on_tool_wait`` decides both; those are its defaults)
    migrate   ``export`` names held KV's blocks in the shared tiers; ``import_`` loads
              them into another engine as held KV (with ``include_tail`` each group's last
              page too, a partial block or a linear state, under a key of its own: a P/D
              hand-over resumes at the exact token, every KV layout)

Every KV layout: each group's published blocks are stored under their pool keys (full attention
every block, sliding window the blocks inside the window, linear attention the checkpoints its
retention kept); a load fetches what the device lacks of the longest hit every group agrees on
(the coordinator's ``plan_tier_hit``). A load that fails midway keeps the longest agreed prefix
that arrived and the request recomputes the rest.
The manager reads and writes KV only through the runner's page gather/scatter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from agentx.config import OffloadConfig
from agentx.engine.block_hash import BlockHash, extend_block_hashes, hash_partial_block
from agentx.engine.hints import ToolLatency
from agentx.engine.kv_cache import KVBlock, KVCacheManager
from agentx.engine.kv_cache.policy import ToolWait
from agentx.engine.offload.interface import KVExport, Offload
from agentx.engine.offload.mooncake_master import MooncakeMaster
from agentx.engine.offload.tiered import TieredStore
from agentx.engine.request import Request


class PageIO(Protocol):
    """How the manager reads and writes device KV (the model runner provides it)."""

    page_bytes: int

    def gather_pages(self, block_ids: list[int]) -> torch.Tensor: ...

    def scatter_pages(self, block_ids: list[int], pages: torch.Tensor) -> None: ...


_NO_PAGES = torch.empty((0, 0), dtype=torch.uint8)  # a load's staging before it is queued


@dataclass(slots=True)
class _Load:
    handle: str | None  # the held KV the blocks become (None: the device cache only)
    request_id: str | None  # the parked request waiting for it (None: a prefetch or import)
    token_ids: list[int]  # tokens of the hit's full blocks (``hashes``)
    device_blocks: list[KVBlock]  # device blocks of the hit, every group (referenced)
    hashes: list[BlockHash]  # the prefix hashes of the hit (token_ids' blocks)
    keys: list[BlockHash]  # the pool keys the pages load under, one per fresh block
    cache_salt: bytes = b""  # the salt the hashes were made with (the held KV keeps it)
    # an exact load (a hand-over): the last ``num_tails`` of keys / blocks / pages are tail
    # pages (partial blocks, linear states: never cached on the device); ``tail_token_ids``
    # follow ``token_ids`` (none when the hit ends at a block boundary)
    tail_token_ids: tuple[int, ...] = ()
    num_tails: int = 0
    blocks: list[KVBlock] = field(default_factory=list)  # fresh blocks the pages land in
    pages: torch.Tensor = _NO_PAGES  # (n, page_bytes) host staging, untouched until the event


@dataclass(slots=True)
class OffloadCounters:
    num_loaded_blocks: int = 0
    num_stored_blocks: int = 0
    num_failed_blocks: int = 0
    num_prefetches: int = 0


@dataclass(slots=True)
class _ToolWait:
    prefetch_at: float  # when to start loading it back (the policy chose it)
    token_ids: list[int]
    block_hashes: list[BlockHash]
    handle: str | None  # the held KV to rebuild; None: back into the device cache
    cache_salt: bytes = b""


class OffloadManager(Offload):
    def __init__(
        self,
        store: TieredStore,
        kv: KVCacheManager,
        runner: PageIO,
        config: OffloadConfig,
        master: MooncakeMaster | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.kv = kv
        self.runner = runner
        self.config = config
        self.master = master  # a mooncake_master this engine started (stopped on close)
        self.clock = clock
        self.block_size = kv.block_size
        self.tier_names = [t.name for t in store.tiers]
        kv.enable_publish_log()
        self.loads: dict[int, _Load] = {}
        self.stores: dict[int, torch.Tensor] = {}  # pages kept alive until their event
        self.tool_hints: dict[str, tuple[float, Request]] = {}  # request id -> latency, request
        self.tool_waits: dict[str, _ToolWait] = {}  # held handle -> expected return
        # held handle -> the hashes its pin holds in the tiers: unpinned when it is released
        self.tier_pins: dict[str, list[BlockHash]] = {}
        self.counters = OffloadCounters()
        self._ready: list[tuple[str, str]] = []  # loads finished during a flush

    # ---- loads ---------------------------------------------------------------------------

    def on_request(self, request: Request) -> bool:
        """Start loading the request's prefix from the tiers; True if it must be parked."""
        for hint in request.hints:
            if isinstance(hint, ToolLatency):
                self.tool_hints[request.request_id] = (hint.seconds, request)
        if request.held_kv is not None:
            self.tool_waits.pop(request.held_kv, None)  # the session is back: no prefetch
        if not self.kv.enable_caching:
            return False
        held = self.kv.get_held(request.held_kv)
        if held is not None and request.all_token_ids[: held.num_tokens] == held.token_ids:
            return False  # the device still holds the whole previous turn
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self._start_load(
            f"offload:{request.request_id}",
            request.request_id,
            request.all_token_ids,
            request.block_hashes[:max_blocks],
            request.cache_salt,
        )

    def _start_load(
        self,
        handle: str | None,
        request_id: str | None,
        token_ids: list[int],
        hashes: list[BlockHash],
        cache_salt: bytes = b"",
    ) -> bool:
        """Load what the device lacks of the longest hit of ``hashes`` that every KV group
        agrees on."""
        hit = self.kv.plan_load(hashes, self.store.contains)
        num = hit.num_blocks
        tokens = token_ids[: num * self.block_size]
        load = _Load(handle, request_id, tokens, hit.device_blocks, hashes[:num], hit.keys)
        load.cache_salt = cache_salt
        return self._queue_load(load)

    def _start_exact_load(self, handle: str, export: KVExport) -> bool:
        """Load an export's exact hit, tail pages included (False: the device and the tiers
        lack some of it, or the pool has no room for it now)."""
        hashes = list(export.block_hashes)
        hit = self.kv.plan_exact_load(
            hashes, export.num_tokens, export.tail_key, self.store.contains
        )
        if hit is None:
            return False
        tokens = list(export.token_ids)
        load = _Load(handle, None, tokens, hit.device_blocks, hashes, hit.keys, export.cache_salt)
        load.tail_token_ids, load.num_tails = export.tail_token_ids, len(hit.tail_groups)
        return self._queue_load(load)

    def _queue_load(self, load: _Load) -> bool:
        """Reference the hit's device blocks, allocate the fresh ones and queue the reads
        (False: nothing to load, nothing taken)."""
        if not load.keys:
            return False
        load.blocks = self.kv.prepare_load(load.device_blocks, len(load.keys))
        load.pages = torch.empty((len(load.keys), self.runner.page_bytes), dtype=torch.uint8)
        ticket = self.store.load(load.keys, list(load.pages))
        self.loads[ticket.job_id] = load
        return True

    def poll(self) -> list[tuple[str, str]]:
        """Drain finished transfers; returns (request id, held handle) of parked requests whose
        load is done. Also starts the prefetches that are due."""
        ready = []
        for event in self.store.take_events():
            if event.kind == "store":
                self.stores.pop(event.job_id, None)
                self.counters.num_stored_blocks += len(event.done)
                continue
            load = self.loads.pop(event.job_id)
            self._finish_load(load, len(event.done))
            if load.request_id is not None:
                ready.append((load.request_id, load.handle))
        self._prefetch_due()
        return ready

    def _finish_load(self, load: _Load, num_done: int) -> None:
        if num_done:
            done_ids = [b.block_id for b in load.blocks[:num_done]]
            self.runner.scatter_pages(done_ids, load.pages[:num_done])
        num_full = len(load.blocks) - load.num_tails
        full, tails = load.blocks[:num_full], load.blocks[num_full:]
        done = self.kv.complete_load(full, load.keys[:num_full], min(num_done, num_full))
        self.counters.num_loaded_blocks += num_done
        self.counters.num_failed_blocks += len(load.blocks) - num_done
        groups = None
        if tails and num_done == len(load.blocks):  # an exact load that landed whole
            num_tokens = len(load.token_ids) + len(load.tail_token_ids)
            groups = self.kv.take_exact_hit(load.hashes, num_tokens, tails)
        if groups is not None:
            token_ids = load.token_ids + list(load.tail_token_ids)
        else:
            self.kv.free_blocks(tails)  # not loaded, or they would not follow their prefix
            # what landed, as the device cache now agrees on it across groups (a failed block
            # shortens the hit to the longest length every group still resumes from)
            groups = self.kv.take_cached_hit(load.hashes) if load.handle is not None else ()
            num_blocks = max((len(g) for g in groups), default=0)
            token_ids = load.token_ids[: num_blocks * self.block_size]
        self.kv.free_blocks(load.device_blocks + done)  # the load's own references
        if load.handle is not None and token_ids:
            self.kv.add_held(load.handle, token_ids, groups, load.cache_salt)

    def idle_wait(self, timeout: float = 0.005) -> None:
        """Nothing to schedule: wait a little for a transfer instead of spinning."""
        if self.loads:
            self.store.worker.wait_idle(timeout)
        elif self.tool_waits:
            time.sleep(timeout)

    # ---- stores and hints after a step ----------------------------------------------------

    def after_step(self) -> None:
        published = self.kv.take_published()
        if published:
            pages = self.runner.gather_pages([b.block_id for _, b in published])
            ticket = self.store.store([h for h, _ in published], list(pages), self.tier_names)
            self.stores[ticket.job_id] = pages
        self._prune_pins()
        for rid in [r for r, (_, req) in self.tool_hints.items() if req.is_finished]:
            seconds, request = self.tool_hints.pop(rid)
            self._on_tool_wait(rid, seconds, request)

    def _on_tool_wait(self, rid: str, seconds: float, request: Request) -> None:
        """A finished turn whose session now waits ``seconds`` on a tool: the KV policy decides
        whether its device blocks are demoted (released first under pressure; the tiers keep
        them) and when they are prefetched back (default: ``prefetch_margin_s`` before the
        tool returns)."""
        now = self.clock()
        held = self.kv.get_held(rid)
        num_tokens = held.num_tokens if held is not None else request.num_computed_tokens
        num_full = num_tokens // self.block_size
        wait = ToolWait(
            rid, seconds, num_tokens, num_full, held is not None, self.config.prefetch_margin_s
        )
        decision = self.kv.policy.on_tool_wait(wait)
        hashes = request.block_hashes[:num_full]
        if held is not None:  # a held turn: released first, reloaded under the same handle
            if decision.demote:
                self.kv.expect_return(rid, now + seconds)
            if decision.prefetch_in_s is not None:
                self.tool_waits[rid] = _ToolWait(
                    now + decision.prefetch_in_s, held.token_ids[:], hashes, rid, request.cache_salt
                )
            return
        if decision.demote:
            self.kv.demote_cached(hashes)
        if decision.prefetch_in_s is not None:
            tokens = request.all_token_ids[: num_full * self.block_size]
            self.tool_waits[f"prefetch:{rid}"] = _ToolWait(
                now + decision.prefetch_in_s, tokens, hashes, None
            )

    def _prefetch_due(self) -> None:
        now = self.clock()
        for handle, wait in list(self.tool_waits.items()):
            if now < wait.prefetch_at:
                continue
            del self.tool_waits[handle]
            if wait.handle is not None and self.kv.get_held(wait.handle) is not None:
                continue  # never left the device
            if self._start_load(
                wait.handle, None, wait.token_ids, wait.block_hashes, wait.cache_salt
            ):
                self.counters.num_prefetches += 1

    def on_release(self, handle: str, drop_cached: bool) -> None:
        self.tool_waits.pop(handle, None)
        pinned = self.tier_pins.pop(handle, None)
        if drop_cached:  # release drops the session's blocks (and their pins) in every tier
            self.store.drop(self.held_hashes(handle) + (pinned or []))
        elif pinned:  # the pin was the held KV's: it ends with it
            self.store.unpin(self._still_unpinned(pinned))

    def _prune_pins(self) -> None:
        """End the tier pins of held KV that is gone (adopted by the next turn, released)."""
        gone = [h for h in self.tier_pins if self.kv.get_held(h) is None]
        if gone:
            hashes = [b for h in gone for b in self.tier_pins.pop(h)]
            self.store.unpin(self._still_unpinned(hashes))

    def _still_unpinned(self, hashes: list[BlockHash]) -> list[BlockHash]:
        """``hashes`` less those another pinned handle still pins (a fork shares them)."""
        kept = {h for others in self.tier_pins.values() for h in others}
        return [h for h in hashes if h not in kept]

    # ---- pins, release, migration ---------------------------------------------------------

    def held_hashes(self, handle: str) -> list[BlockHash]:
        """The tier keys of held KV's cached blocks, every KV group (pins, drops)."""
        return self.kv.get_held_keys(handle)

    def pin(self, handle: str, pinned: bool) -> None:
        if pinned:
            hashes = self.held_hashes(handle)
            self.tier_pins[handle] = hashes
            self.store.pin(hashes)
        else:
            hashes = self.tier_pins.pop(handle, None) or self.held_hashes(handle)
            self.store.unpin(self._still_unpinned(hashes))

    def export(
        self, handle: str, include_tail: bool = False, timeout: float = 30.0
    ) -> KVExport | None:
        """The held KV's prefix as far as the tiers complete a hit of it in every KV group
        (waits for the stores); with ``include_tail`` the whole of it: each group's last page
        that no prefix hash names (a partial block, a linear state) goes to the tiers under a
        key of its own, so the importer resumes at the exact token in every layout."""
        held = self.kv.get_held(handle)
        if held is None:
            return None
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, held.token_ids, self.block_size, held.cache_salt)
        num_full = len(hashes)
        tail = tuple(held.token_ids[num_full * self.block_size :])
        tail_key = hash_partial_block(hashes[-1] if hashes else None, tail, held.cache_salt)
        tails = self.kv.get_held_tails(handle, tail_key) if include_tail else []
        if tails:
            pages = self.runner.gather_pages([b.block_id for _, b in tails])
            ticket = self.store.store([k for k, _ in tails], list(pages), self.tier_names)
            self.stores[ticket.job_id] = pages
        self.flush(timeout)
        contains = self.store.contains
        exact = tails and self.kv.plan_exact_load(
            hashes, held.num_tokens, tail_key, contains, use_device=False
        )
        if exact:
            token_ids = tuple(held.token_ids[: num_full * self.block_size])
            return KVExport(token_ids, tuple(hashes), tail, tail_key, held.cache_salt)
        if tails:  # a full block it needs is not in the tiers: its tail pages are no use
            self.store.drop([k for k, _ in tails])
        num = self.kv.plan_tier_only(hashes, contains)
        token_ids = tuple(held.token_ids[: num * self.block_size])
        return KVExport(token_ids, tuple(hashes[:num]), (), None, held.cache_salt)

    def import_(self, export: KVExport, handle: str, timeout: float = 30.0) -> int:
        """Load an exported prefix as held KV ``handle``, exactly with a tail (else, or when
        the tiers lost some of it, the longest prefix every group agrees on); returns its
        tokens on the device. Tail keys are dropped from the tiers after: they name one
        hand-over."""
        exact = export.tail_key is not None and self._start_exact_load(handle, export)
        if not exact:
            tokens, hashes = list(export.token_ids), list(export.block_hashes)
            self._start_load(handle, None, tokens, hashes, export.cache_salt)
        self.flush(timeout)
        if export.tail_key is not None:
            self.store.drop(self.kv.get_tail_keys(export.tail_key))
        held = self.kv.get_held(handle)
        return 0 if held is None else held.num_tokens

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for every queued transfer and apply the finished ones (tests, migration)."""
        deadline = time.monotonic() + timeout
        while self.store.num_pending and time.monotonic() < deadline:
            self.store.worker.wait_idle(max(0.0, deadline - time.monotonic()))
            self._ready.extend(self.poll())

    def take_ready(self) -> list[tuple[str, str]]:
        """Loads finished during ``flush`` (their requests still wait to be put back in line)."""
        out, self._ready = self._ready, []
        return out

    def has_pending(self) -> bool:
        return bool(self.loads or self.tool_waits or self._ready)

    def get_stats(self) -> dict[str, int]:
        c = self.counters
        return {
            "offload_loaded_blocks": c.num_loaded_blocks,
            "offload_stored_blocks": c.num_stored_blocks,
            "offload_failed_blocks": c.num_failed_blocks,
            "offload_num_prefetches": c.num_prefetches,
        }

    def get_referenced_blocks(self) -> list[KVBlock]:
        return [b for load in self.loads.values() for b in (*load.device_blocks, *load.blocks)]

    def check_integrity(self) -> None:
        self.store.check_integrity()
        for load in self.loads.values():
            assert all(b.ref_cnt > 0 for b in load.blocks), f"{load.handle}: a loading block freed"

    def close(self) -> None:
        self.store.close()
        if self.master is not None:
            self.master.stop()
