"""The tiered store: host -> disk -> Mooncake chained top-down behind one small API.

What the engine core calls (all on the engine thread, none blocks on I/O)::

    hit = store.lookup(hashes)              # TierLookup: leading hashes held by any tier
    t = store.load(hashes, pages)           # pins the hit prefix, queues the reads -> ticket
    t = store.store(hashes, pages, tiers)   # queues writes to the chosen tiers -> ticket
    for ev in store.take_events(): ...      # TransferEvent per finished ticket
    store.pin / unpin / drop(hashes)        # hints and release, in every tier

The pages given to ``load``/``store`` are CPU uint8 tensors of ``page_bytes`` (host staging the
engine gathers from / scatters to the device); they must stay untouched until the ticket's event
is drained. Policies inside:

- a hit in any tier is a hit; each block loads from the top-most tier that holds it;
- promote on hit: a block loaded from a lower tier is also written to the top tier;
- demote on eviction: a block the top tier evicts is written to the tier below it (unless
  already there) before its slot is reused;
- an unhealthy tier is skipped (its lookups miss, its stores are not planned).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentx.engine.block_hash import BlockHash
from agentx.engine.offload.base import KVTier, TierStats, check_pages
from agentx.engine.offload.jobs import LoadJob, StoreJob, TierOp
from agentx.engine.offload.transfer import TransferEvent, TransferWorker

__all__ = ["TierLookup", "TieredStore", "TransferTicket"]


@dataclass(frozen=True, slots=True)
class TierLookup:
    """``num_hits`` leading hashes are held by some tier; ``tiers[i]`` names the top-most one."""

    num_hits: int
    tiers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TransferTicket:
    """A queued job: its event will carry ``job_id``; ``hashes`` are the ones it covers (for a
    load, the hit prefix that will be read into the first ``len(hashes)`` pages)."""

    job_id: int
    kind: str
    hashes: tuple[BlockHash, ...]


class TieredStore:
    """Tiers top-down plus the transfer worker that moves their bytes.

    ``tiers`` go from fastest to slowest and share one ``page_bytes``. ``promote`` copies lower
    hits into the top tier; ``demote`` writes the top tier's victims into the tier below.
    """

    def __init__(
        self,
        tiers: Sequence[KVTier],
        worker: TransferWorker | None = None,
        promote: bool = True,
        demote: bool = True,
    ) -> None:
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if len({t.page_bytes for t in tiers}) != 1:
            raise ValueError("every tier must use the same page_bytes")
        self.tiers = list(tiers)
        self.page_bytes = tiers[0].page_bytes
        self.promote = promote and len(tiers) > 1
        self.demote = demote and len(tiers) > 1
        for tier in self.tiers[:-1]:
            tier.record_evictions = self.demote
        self.worker = worker or TransferWorker()
        self._job_ids = itertools.count(1)
        self._pending: dict[int, str] = {}
        self.num_hits = {t.name: 0 for t in self.tiers}  # blocks loaded, per source tier
        self.num_misses = 0  # loads whose prefix stopped short of the request

    def get_tier(self, name: str) -> KVTier:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(name)

    # --- lookups ------------------------------------------------------------------------------

    def _presence(self, hashes: Sequence[BlockHash]) -> list[KVTier | None]:
        """Per leading hash, the top-most healthy tier holding it; stops at the first miss."""
        owner: list[KVTier | None] = [None] * len(hashes)
        remaining = list(range(len(hashes)))
        for tier in self.tiers:
            if not remaining or not tier.healthy:
                continue
            found = tier.contains([hashes[i] for i in remaining])
            for i, present in zip(remaining, found, strict=True):
                if present:
                    owner[i] = tier
            remaining = [i for i in remaining if owner[i] is None]
        num = next((i for i, t in enumerate(owner) if t is None), len(owner))
        return owner[:num]

    def lookup(self, hashes: Sequence[BlockHash]) -> TierLookup:
        """How many leading hashes some tier holds, and which. No pins, no I/O beyond the
        tiers' own lookups (Mooncake: one bounded RPC)."""
        owner = self._presence(hashes)
        return TierLookup(len(owner), tuple(t.name for t in owner))

    def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Per hash, whether some healthy tier holds it (not only a leading run: a hybrid
        layout's hit needs scattered blocks per group). No pins."""
        found = [False] * len(hashes)
        for tier in self.tiers:
            remaining = [i for i, f in enumerate(found) if not f]
            if not remaining or not tier.healthy:
                continue
            flags = tier.contains([hashes[i] for i in remaining])
            for i, present in zip(remaining, flags, strict=True):
                found[i] = present
        return found

    # --- loads --------------------------------------------------------------------------------

    def load(self, hashes: Sequence[BlockHash], pages: Sequence[torch.Tensor]) -> TransferTicket:
        """Queue reads of the leading hit prefix of ``hashes`` into the first pages.

        ``pages`` has one page per hash (extra pages past the hit are untouched). The blocks are
        pinned in their tiers until the job ends. The ticket says how many will be loaded; the
        event's ``done`` says how many were (failures -> recompute).
        """
        check_pages(pages, len(hashes), self.page_bytes)
        owner = self._presence(hashes)
        reads: list[TierOp] = []
        num = 0
        for tier, group in itertools.groupby(range(len(owner)), key=lambda i: owner[i]):
            idx = list(group)
            run = [hashes[i] for i in idx]
            pinned = tier.prepare_load(run)  # may be short if a block vanished meanwhile
            if pinned:
                op = TierOp(tier, tuple(run[:pinned]), tuple(pages[i] for i in idx[:pinned]))
                reads.append(op)
            num += pinned
            if pinned < len(run):
                break
        loaded = tuple(hashes[:num])
        self._count_lookup(reads, num < len(hashes))
        demotions, promotion = self._plan_promotion(reads)
        job = LoadJob(next(self._job_ids), loaded, reads, demotions, promotion)
        return self._submit(job, "load")

    def _count_lookup(self, reads: list[TierOp], missed: bool) -> None:
        for op in reads:
            self.num_hits[op.tier.name] += len(op.hashes)
        self.num_misses += missed

    def _plan_promotion(self, reads: list[TierOp]) -> tuple[list[TierOp], TierOp | None]:
        top = self.tiers[0]
        if not self.promote or not top.healthy:
            return [], None
        lower = [
            (h, p)
            for op in reads
            if op.tier is not top
            for h, p in zip(op.hashes, op.pages, strict=True)
        ]
        if not lower:
            return [], None
        page_of = dict(lower)
        planned = top.prepare_store([h for h, _ in lower])
        demotions = self._plan_demotions(0)
        if not planned:
            return demotions, None
        return demotions, TierOp(top, tuple(planned), tuple(page_of[h] for h in planned))

    # --- stores -------------------------------------------------------------------------------

    def store(
        self,
        hashes: Sequence[BlockHash],
        pages: Sequence[torch.Tensor],
        tiers: Sequence[str] | None = None,
    ) -> TransferTicket:
        """Queue writes of the blocks to ``tiers`` (names; default: the top tier).

        Blocks a tier already holds or is already writing are skipped there; a tier that is
        full of in-flight blocks or unhealthy skips them. The event's ``done`` holds the hashes
        held by at least one target tier once the job ends.
        """
        check_pages(pages, len(hashes), self.page_bytes)
        targets = [self.get_tier(n) for n in tiers] if tiers else [self.tiers[0]]
        page_of = dict(zip(hashes, pages, strict=True))
        ops: list[TierOp] = []
        present: set[BlockHash] = set()
        for tier in sorted(targets, key=self.tiers.index):
            if not tier.healthy:
                continue
            present.update(h for h, p in zip(hashes, tier.contains(hashes), strict=True) if p)
            planned = tier.prepare_store(hashes)
            ops.extend(self._plan_demotions(self.tiers.index(tier)))
            if planned:
                ops.append(TierOp(tier, tuple(planned), tuple(page_of[h] for h in planned)))
        job = StoreJob(next(self._job_ids), tuple(hashes), present, ops, tuple(targets))
        return self._submit(job, "store")

    def _plan_demotions(self, level: int) -> list[TierOp]:
        """Writes of the blocks tier ``level`` just evicted into the tier below it."""
        evicted = self.tiers[level].take_evicted()
        if not self.demote or level + 1 >= len(self.tiers):
            return []
        lower = self.tiers[level + 1]
        with_page = {e.block_hash: e.page for e in evicted if e.page is not None}
        if not with_page or not lower.healthy:
            return []
        planned = lower.prepare_store(list(with_page))
        lower.take_evicted()  # the lower tier's own victims have no page to demote further
        if not planned:
            return []
        return [TierOp(lower, tuple(planned), tuple(with_page[h] for h in planned))]

    # --- hints, events, state -----------------------------------------------------------------

    def pin(self, hashes: Sequence[BlockHash]) -> None:
        """Hint: evict these last, in every tier (also when stored later). Pins are kept by
        hash until ``unpin`` or ``drop``: the caller ends the hint."""
        for tier in self.tiers:
            tier.pin(hashes)

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        for tier in self.tiers:
            tier.unpin(hashes)

    def drop(self, hashes: Sequence[BlockHash]) -> None:
        """Release: forget the blocks in every tier."""
        for tier in self.tiers:
            tier.drop(hashes)

    def _submit(self, job: StoreJob | LoadJob, kind: str) -> TransferTicket:
        self._pending[job.job_id] = kind
        self.worker.submit(job)
        return TransferTicket(job.job_id, kind, job.hashes if kind == "store" else job.loaded)

    def take_events(self) -> list[TransferEvent]:
        """Drain finished jobs' events (submission order)."""
        events = self.worker.take_events()
        for event in events:
            del self._pending[event.job_id]
        return events

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every queued job has its event (shutdown, tests). True if idle."""
        return self.worker.wait_idle(timeout)

    @property
    def num_pending(self) -> int:
        """Jobs whose events have not been drained yet."""
        return len(self._pending)

    def get_stats(self) -> list[TierStats]:
        return [t.get_stats() for t in self.tiers]

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()
        if not self._pending:  # nothing in flight: no tier may hold a leaked pin or reservation
            for stats in self.get_stats():
                assert stats.num_in_flight == 0, f"{stats.name} leaked {stats.num_in_flight}"

    def close(self) -> None:
        """Finish queued jobs, stop the worker, close the tiers."""
        self.worker.close()
        for tier in self.tiers:
            tier.close()
