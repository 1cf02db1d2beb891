"""Host-memory tier: a preallocated slab of pages, pinned when CUDA is available.

The slab is one ``(num_blocks, page_bytes)`` uint8 tensor allocated up front; a block owns one
row (its slot). Pinned memory lets the engine copy device pages to and from the slab with
non-blocking transfers. Evicted slots are handed out as ``EvictedBlock.page`` views so the tiered
store can demote them to disk before the worker overwrites the slot.
"""

from __future__ import annotations

import torch

from agentx.engine.block_hash import BlockHash
from agentx.engine.offload.base import EvictedBlock
from agentx.engine.offload.index import IndexedTier, IndexEntry

__all__ = ["HostTier"]


class HostTier(IndexedTier):
    """``num_blocks`` pages of ``page_bytes`` in host memory; capacity is counted in blocks."""

    def __init__(
        self, page_bytes: int, num_blocks: int, pin_memory: bool | None = None, name: str = "host"
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        super().__init__(name, page_bytes, capacity=num_blocks)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.slab = torch.empty((num_blocks, page_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        self._free_slots = list(range(num_blocks - 1, -1, -1))  # pop() hands out slot 0 first

    def get_page(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The slab row of a present block (a view; for the engine's direct copies)."""
        with self._lock:
            if not self._index.is_present(block_hash):
                return None
            return self.slab[self._index.entries[block_hash].slot]

    def _block_size(self) -> int:
        return 1

    def _assign(self, block_hash: BlockHash, entry: IndexEntry) -> None:
        entry.slot = self._free_slots.pop()

    def _release(self, block_hash: BlockHash, entry: IndexEntry, evicted: bool) -> None:
        self._free_slots.append(entry.slot)
        if evicted and self.record_evictions:
            self._evicted.append(EvictedBlock(block_hash, self.slab[entry.slot]))

    def _write_block(self, block_hash: BlockHash, entry: IndexEntry, page: torch.Tensor) -> bool:
        self.slab[entry.slot].copy_(page.view(-1))
        return True

    def _read_block(self, block_hash: BlockHash, entry: IndexEntry, page: torch.Tensor) -> bool:
        page.view(-1).copy_(self.slab[entry.slot])
        return True

    def check_integrity(self) -> None:
        super().check_integrity()
        with self._lock:
            slots = [e.slot for e in self._index.entries.values()]
            assert len(set(slots)) == len(slots), "two blocks share a slot"
            assert not set(slots) & set(self._free_slots), "a used slot is also free"
            assert len(slots) + len(self._free_slots) == self._index.capacity, "leaked slot"
