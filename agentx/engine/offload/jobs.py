"""The two job kinds the tiered store queues on the transfer worker.

A job is a list of prepared tier operations (``TierOp``), run in order. Every op is completed
exactly once, by ``run`` or, if ``run`` raised, by ``fail``: stores as failed, loads unpinned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agentx.engine.block_hash import BlockHash
from agentx.engine.offload.base import KVTier
from agentx.engine.offload.transfer import TransferEvent, TransferJob

__all__ = ["LoadJob", "StoreJob", "TierOp"]


@dataclass(slots=True)
class TierOp:
    """Prepared transfer of ``hashes`` between ``tier`` and ``pages`` (same order)."""

    tier: KVTier
    hashes: tuple[BlockHash, ...]
    pages: tuple[torch.Tensor, ...]
    closed: bool = field(default=False, compare=False)

    def write(self, only: set[BlockHash] | None = None) -> list[bool]:
        """Write (all, or the hashes in ``only``) and complete the store."""
        want = [i for i, h in enumerate(self.hashes) if only is None or h in only]
        written = self.tier.write([self.hashes[i] for i in want], [self.pages[i] for i in want])
        ok = [False] * len(self.hashes)
        for i, good in zip(want, written, strict=True):
            ok[i] = good
        self.close_store(ok)
        return ok

    def close_store(self, ok: list[bool]) -> None:
        if not self.closed:
            self.closed = True
            self.tier.complete_store(self.hashes, ok)

    def close_load(self) -> None:
        if not self.closed:
            self.closed = True
            self.tier.complete_load(self.hashes)


class StoreJob(TransferJob):
    """Writes into one or more tiers (demotions first, in planning order)."""

    def __init__(
        self,
        job_id: int,
        hashes: tuple[BlockHash, ...],
        present: set[BlockHash],
        ops: list[TierOp],
        targets: tuple[KVTier, ...],
    ) -> None:
        self.job_id = job_id
        self.kind = "store"
        self.hashes = hashes
        self.present = present  # held by a target tier before the job: done, not rewritten
        self.ops = ops
        self.targets = targets

    def run(self) -> TransferEvent:
        written: set[BlockHash] = set()
        attempted: set[BlockHash] = set()
        for op in self.ops:
            ok = op.write()
            if op.tier in self.targets:
                attempted.update(op.hashes)
                written.update(h for h, good in zip(op.hashes, ok, strict=True) if good)
        return self._event(written, attempted)

    def fail(self, exc: BaseException) -> TransferEvent:
        attempted: set[BlockHash] = set()
        for op in self.ops:
            op.close_store([False] * len(op.hashes))
            if op.tier in self.targets:
                attempted.update(op.hashes)
        return self._event(set(), attempted)

    def _event(self, written: set[BlockHash], attempted: set[BlockHash]) -> TransferEvent:
        done = written | self.present
        return TransferEvent(
            self.job_id,
            "store",
            done=tuple(h for h in self.hashes if h in done),
            failed=tuple(h for h in self.hashes if h in attempted and h not in done),
            skipped=tuple(h for h in self.hashes if h not in attempted and h not in done),
        )


class LoadJob(TransferJob):
    """Reads a hit prefix tier by tier, then promotes what came from below into the top tier."""

    def __init__(
        self,
        job_id: int,
        loaded: tuple[BlockHash, ...],
        reads: list[TierOp],
        demotions: list[TierOp],
        promotion: TierOp | None,
    ) -> None:
        self.job_id = job_id
        self.kind = "load"
        self.hashes = self.loaded = loaded
        self.reads = reads
        self.demotions = demotions  # victims of the promotion, written below before it lands
        self.promotion = promotion

    def run(self) -> TransferEvent:
        good: set[BlockHash] = set()
        failed = False
        for op in self.reads:
            if not failed:
                ok = op.tier.read(op.hashes, op.pages)
                good.update(h for h, g in zip(op.hashes, ok, strict=True) if g)
                failed = not all(ok)
            op.close_load()
        num = next((i for i, h in enumerate(self.loaded) if h not in good), len(self.loaded))
        done = self.loaded[:num]
        done_set = set(done)
        for op in self.demotions:
            op.write()
        if self.promotion is not None:
            self.promotion.write(only=done_set)
        return TransferEvent(self.job_id, "load", done=done, failed=self.loaded[num:])

    def fail(self, exc: BaseException) -> TransferEvent:
        for op in self.reads:
            op.close_load()
        for op in [*self.demotions, *([self.promotion] if self.promotion else [])]:
            op.close_store([False] * len(op.hashes))
        return TransferEvent(self.job_id, "load", done=(), failed=self.loaded)
