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
              them into another engine as held KV (with ``include_tail`` the partial last
              block too, under a key of its own: a P/D hand-over resumes at the exact token)

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
from dataclasses import dataclass
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


@dataclass(slots=True)
class _Load:
    handle: str | None  # the held KV the blocks become (None: the device cache only)
    request_id: str | None  # the parked request waiting for it (None: a prefetch or import)
    token_ids: list[int]  # tokens of the hit's blocks (``hashes``)
    device_blocks: list[KVBlock]  # device blocks of the hit, every group (referenced)
    blocks: list[KVBlock]  # fresh device blocks the pages land in
    hashes: list[BlockHash]  # the prefix hashes of the hit (token_ids' blocks)
    keys: list[BlockHash]  # the pool keys the pages load under, one per fresh block
    pages: torch.Tensor  # (n, page_bytes) host staging, untouched until the event
    cache_salt: bytes = b""  # the salt the hashes were made with (the held KV keeps it)
    # a partial last block's tokens: then the last of blocks / hashes / pages is that block
    # (never cached on the device: it is not full)
    tail_token_ids: tuple[int, ...] = ()


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
        tail: tuple[BlockHash, tuple[int, ...]] | None = None,
    ) -> bool:
        """Load what the device lacks of the longest hit of ``hashes`` that every KV group
        agrees on (then ``tail``: a partial block's key and tokens, single-group layouts,
        loaded only if every full block before it is)."""
        single = len(self.kv.layout.groups) == 1  # a partial block of one group only
        with_tail = single and tail is not None and self.store.contains([tail[0]])[0]
        hit = self.kv.plan_load(hashes, self.store.contains, num_reserved=int(with_tail))
        with_tail = with_tail and hit.num_blocks == len(hashes)
        keys = hit.keys + ([tail[0]] if tail is not None and with_tail else [])
        if not keys:
            return False
        blocks = self.kv.prepare_load(hit.device_blocks, len(keys))
        pages = torch.empty((len(keys), self.runner.page_bytes), dtype=torch.uint8)
        ticket = self.store.load(keys, list(pages))
        self.loads[ticket.job_id] = _Load(
            handle,
            request_id,
            token_ids[: hit.num_blocks * self.block_size],
            hit.device_blocks,
            blocks,
            list(hashes[: hit.num_blocks]),
            keys,
            pages,
            cache_salt,
            tail[1] if tail is not None and with_tail else (),
        )
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
        num_full = len(load.blocks) - bool(load.tail_token_ids)
        full, tail = load.blocks[:num_full], load.blocks[num_full:]
        done = self.kv.complete_load(full, load.keys[:num_full], min(num_done, num_full))
        self.counters.num_loaded_blocks += num_done
        self.counters.num_failed_blocks += len(load.blocks) - num_done
        # what landed, as the device cache now agrees on it across groups (a failed block
        # shortens the hit to the longest length every group still resumes from)
        groups = self.kv.take_cached_hit(load.hashes) if load.handle is not None else ()
        self.kv.free_blocks(load.device_blocks + done)  # the load's own references
        if load.handle is None:  # a prefetch into the device cache: most recently used now
            return
        num_blocks = max((len(g) for g in groups), default=0)
        token_ids = load.token_ids[: num_blocks * self.block_size]
        if tail and num_done == len(load.blocks) and num_blocks == len(load.hashes):
            groups[0].extend(tail)
            token_ids = token_ids + list(load.tail_token_ids)
        else:
            self.kv.free_blocks(tail)  # not loaded, or its block would not follow a full prefix
        if token_ids:
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
        (waits for the stores); with ``include_tail`` its partial last block too (single-group
        layouts: a hybrid's importer resumes from the last agreed block boundary)."""
        held = self.kv.get_held(handle)
        if held is None:
            return None
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, held.token_ids, self.block_size, held.cache_salt)
        num_full = len(hashes)
        tail = held.token_ids[num_full * self.block_size :]
        tail_key = None
        if include_tail and tail and len(self.kv.layout.groups) == 1:
            tail_key = hash_partial_block(hashes[-1] if hashes else None, tail, held.cache_salt)
            pages = self.runner.gather_pages([held.blocks[0][num_full].block_id])
            ticket = self.store.store([tail_key], list(pages), self.tier_names)
            self.stores[ticket.job_id] = pages
        self.flush(timeout)
        num = self.kv.plan_tier_only(hashes, self.store.contains)
        with_tail = tail_key is not None and num == num_full and self.store.contains([tail_key])[0]
        return KVExport(
            tuple(held.token_ids[: num * self.block_size]),
            tuple(hashes[:num]),
            tuple(tail) if with_tail else (),
            tail_key if with_tail else None,
            held.cache_salt,
        )

    def import_(self, export: KVExport, handle: str, timeout: float = 30.0) -> int:
        """Load an exported prefix as held KV ``handle``; returns its tokens on device. A
        tail's key is dropped from the tiers after: it names one hand-over."""
        tail = None
        if export.tail_key is not None:
            tail = (export.tail_key, export.tail_token_ids)
        self._start_load(
            handle,
            None,
            list(export.token_ids),
            list(export.block_hashes),
            export.cache_salt,
            tail,
        )
        self.flush(timeout)
        if tail is not None:
            self.store.drop([tail[0]])
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
