"""The bookkeeping shared by tiers that own their storage (host slab, disk folder).

``BlockIndex`` holds one entry per block a tier knows, in LRU order, with its size (in the
tier's capacity unit: slots or bytes), its in-flight state and its pins. ``IndexedTier``
implements the whole :class:`KVTier` protocol on top of it under one lock; a subclass only moves
bytes (``_write_block``/``_read_block``) and releases storage (``_release``).

Eviction order (``BlockIndex.reserve``)::

    oldest ... newest        pass 1: idle and not pinned   -> evicted first, oldest first
                             pass 2: idle and pinned       -> evicted last, oldest first
                             storing / loading             -> never
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentx.engine.block_hash import BlockHash
from agentx.engine.offload.base import EvictedBlock, KVTier, TierStats, check_pages

__all__ = ["BlockIndex", "IndexEntry", "IndexedTier"]


@dataclass(slots=True)
class IndexEntry:
    size: int
    slot: int = -1  # where the bytes live, for tiers with slots
    storing: bool = True
    num_readers: int = 0
    doomed: bool = False  # dropped or corrupt while in flight: removed when the transfer ends

    @property
    def busy(self) -> bool:
        return self.storing or self.num_readers > 0


class BlockIndex:
    """LRU index with pins and in-flight protection; not thread-safe (the tier locks)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.entries: OrderedDict[BlockHash, IndexEntry] = OrderedDict()  # oldest first
        self.pinned: set[BlockHash] = set()

    def is_present(self, block_hash: BlockHash) -> bool:
        entry = self.entries.get(block_hash)
        return entry is not None and not entry.storing and not entry.doomed

    def touch(self, block_hash: BlockHash) -> None:
        self.entries.move_to_end(block_hash)

    def reserve(
        self, block_hash: BlockHash, size: int
    ) -> tuple[IndexEntry | None, list[tuple[BlockHash, IndexEntry]]]:
        """Add a ``storing`` entry, evicting idle blocks if needed; (None, []) if it cannot fit."""
        need = self.used + size - self.capacity
        victims: list[tuple[BlockHash, IndexEntry]] = []
        if need > 0:
            victims = self._pick_victims(need)
            if victims is None:
                return None, []
            for victim_hash, _ in victims:
                self.remove(victim_hash)
        entry = IndexEntry(size)
        self.entries[block_hash] = entry
        self.used += size
        return entry, victims

    def _pick_victims(self, need: int) -> list[tuple[BlockHash, IndexEntry]] | None:
        victims, freed = [], 0
        for want_pinned in (False, True):
            for block_hash, entry in self.entries.items():
                if entry.busy or (block_hash in self.pinned) != want_pinned:
                    continue
                victims.append((block_hash, entry))
                freed += entry.size
                if freed >= need:
                    return victims
        return None

    def remove(self, block_hash: BlockHash) -> IndexEntry:
        entry = self.entries.pop(block_hash)
        self.used -= entry.size
        return entry

    def check_integrity(self) -> None:
        assert self.used == sum(e.size for e in self.entries.values()), "used != sum of sizes"
        assert 0 <= self.used <= self.capacity, f"used {self.used} of {self.capacity}"
        for block_hash, entry in self.entries.items():
            assert entry.num_readers >= 0, f"negative readers on {block_hash.hex()}"
            assert not (entry.storing and entry.num_readers), "a storing block has readers"
            assert not entry.doomed or entry.busy, "an idle block is doomed but still indexed"


class IndexedTier(KVTier):
    """KVTier bookkeeping over a BlockIndex; subclasses move the bytes."""

    def __init__(self, name: str, page_bytes: int, capacity: int) -> None:
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        self.name = name
        self.page_bytes = page_bytes
        self._index = BlockIndex(capacity)
        self._lock = threading.Lock()
        self._evicted: list[EvictedBlock] = []
        self._counts = dict(stored=0, loaded=0, evicted=0, failed=0)

    # --- what a subclass provides -------------------------------------------------------------

    @abstractmethod
    def _block_size(self) -> int:
        """Capacity units one block takes."""

    @abstractmethod
    def _assign(self, block_hash: BlockHash, entry: IndexEntry) -> None:
        """Give a freshly reserved entry its storage (a slot). Under the lock."""

    @abstractmethod
    def _release(self, block_hash: BlockHash, entry: IndexEntry, evicted: bool) -> None:
        """Free the storage of a removed entry; record an EvictedBlock if ``evicted``. Under
        the lock; must not do slow I/O (defer it to the worker)."""

    @abstractmethod
    def _write_block(self, block_hash: BlockHash, entry: IndexEntry, page: torch.Tensor) -> bool:
        """Worker thread, without the lock."""

    @abstractmethod
    def _read_block(self, block_hash: BlockHash, entry: IndexEntry, page: torch.Tensor) -> bool:
        """Worker thread, without the lock."""

    # --- KVTier -------------------------------------------------------------------------------

    def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        with self._lock:
            return [self._index.is_present(h) for h in hashes]

    def prepare_store(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        out: list[BlockHash] = []
        with self._lock:
            for block_hash in dict.fromkeys(hashes):  # dedup, keep order
                if block_hash in self._index.entries:
                    continue
                entry, victims = self._index.reserve(block_hash, self._block_size())
                if entry is None:
                    continue
                for victim_hash, victim in victims:
                    self._counts["evicted"] += 1
                    self._release(victim_hash, victim, evicted=True)
                self._assign(block_hash, entry)
                out.append(block_hash)
        return out

    def write(self, hashes: Sequence[BlockHash], pages: Sequence[torch.Tensor]) -> list[bool]:
        check_pages(pages, len(hashes), self.page_bytes)
        with self._lock:
            entries = [self._index.entries[h] for h in hashes]
        assert all(e.storing for e in entries), "write() of a block that prepare_store did not"
        return [self._write_block(h, e, p) for h, e, p in zip(hashes, entries, pages, strict=True)]

    def complete_store(self, hashes: Sequence[BlockHash], ok: Sequence[bool]) -> None:
        with self._lock:
            for block_hash, good in zip(hashes, ok, strict=True):
                entry = self._index.entries[block_hash]
                assert entry.storing, f"complete_store of {block_hash.hex()} not storing"
                entry.storing = False
                if good and not entry.doomed:
                    self._counts["stored"] += 1
                    self._index.touch(block_hash)
                else:
                    self._counts["failed"] += not good
                    self._forget(block_hash)

    def prepare_load(self, hashes: Sequence[BlockHash]) -> int:
        with self._lock:
            num = 0
            for block_hash in hashes:
                if not self._index.is_present(block_hash):
                    break
                self._index.entries[block_hash].num_readers += 1
                self._index.touch(block_hash)
                num += 1
        return num

    def read(self, hashes: Sequence[BlockHash], pages: Sequence[torch.Tensor]) -> list[bool]:
        check_pages(pages, len(hashes), self.page_bytes)
        with self._lock:
            entries = [self._index.entries[h] for h in hashes]
        assert all(e.num_readers > 0 for e in entries), "read() of a block not prepare_load-ed"
        out = []
        for block_hash, entry, page in zip(hashes, entries, pages, strict=True):
            good = self._read_block(block_hash, entry, page)
            if not good:
                with self._lock:
                    entry.doomed = True  # untrusted bytes: never served again
            out.append(good)
        return out

    def complete_load(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            for block_hash in hashes:
                entry = self._index.entries[block_hash]
                assert entry.num_readers > 0, f"complete_load of {block_hash.hex()} not loading"
                entry.num_readers -= 1
                if entry.doomed:
                    self._counts["failed"] += 1
                    if not entry.busy:
                        self._forget(block_hash)
                else:
                    self._counts["loaded"] += 1

    def pin(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            self._index.pinned.update(hashes)

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            self._index.pinned.difference_update(hashes)

    def drop(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            for block_hash in hashes:
                self._index.pinned.discard(block_hash)
                entry = self._index.entries.get(block_hash)
                if entry is None:
                    continue
                if entry.busy:
                    entry.doomed = True
                else:
                    self._forget(block_hash)

    def _forget(self, block_hash: BlockHash) -> None:
        entry = self._index.remove(block_hash)
        self._release(block_hash, entry, evicted=False)

    def take_evicted(self) -> list[EvictedBlock]:
        with self._lock:
            out, self._evicted = self._evicted, []
        return out

    def get_lru_order(self) -> list[BlockHash]:
        """Present and in-flight hashes, least recently used first (for tests and debugging)."""
        with self._lock:
            return list(self._index.entries)

    def get_stats(self) -> TierStats:
        with self._lock:
            entries = self._index.entries
            return TierStats(
                name=self.name,
                num_blocks=sum(not e.storing for e in entries.values()),
                used=self._index.used,
                capacity=self._index.capacity,
                num_pinned=sum(h in self._index.pinned for h in entries),
                num_in_flight=sum(e.busy for e in entries.values()),
                num_stored=self._counts["stored"],
                num_loaded=self._counts["loaded"],
                num_evicted=self._counts["evicted"],
                num_failed=self._counts["failed"],
                healthy=self.healthy,
            )

    def check_integrity(self) -> None:
        with self._lock:
            self._index.check_integrity()
