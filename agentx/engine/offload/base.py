"""The KV tier contract: one storage level below device memory (host RAM, disk, Mooncake Store).

A tier stores whole blocks. The key is the block hash of the prefix cache
(:mod:`agentx.engine.block_hash`), the same chain in every tier, so a lookup walks the
same hashes everywhere. The value is one block's page: a contiguous ``uint8`` tensor of exactly
``page_bytes`` bytes (all layers of the block; the engine gathers and scatters it).

Two threads touch a tier, and the methods say which:

- the engine thread does bookkeeping only: ``contains``/``lookup``, ``prepare_*``,
  ``pin``/``unpin``/``drop``, ``take_evicted``, ``get_stats``, ``check_integrity``;
- the transfer worker moves bytes: ``write``/``read`` (and calls ``complete_*`` after them).

Every public method is thread-safe. Nothing here knows requests, the scheduler or the device.

State of one block in a tier::

    absent --prepare_store--> storing --complete_store(ok)--> present <--> loading (readers > 0)
               (may evict)          +--complete_store(fail)--> absent
    present --evict / drop--> absent  (a block that is storing or loading is never evicted; a
                                       drop while it is in flight takes effect when it lands)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentx.engine.block_hash import BlockHash

__all__ = ["EvictedBlock", "KVTier", "TierStats", "check_pages"]


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of one tier's counters (``used``/``capacity`` in the tier's own unit)."""

    name: str
    num_blocks: int
    used: int
    capacity: int
    num_pinned: int
    num_in_flight: int
    num_stored: int
    num_loaded: int
    num_evicted: int
    num_failed: int
    healthy: bool


@dataclass(frozen=True, slots=True)
class EvictedBlock:
    """A block a tier evicted to make room.

    ``page`` is a view of the evicted bytes when the tier can still hand them out (the host tier:
    the slab slot), valid until the next ``write`` into that tier; ``None`` otherwise. The tiered
    store uses it to demote the block to the tier below before the slot is overwritten.
    """

    block_hash: BlockHash
    page: torch.Tensor | None


def check_pages(pages: Sequence[torch.Tensor], num: int, page_bytes: int) -> None:
    """Raise ValueError unless ``pages`` holds ``num`` contiguous uint8 pages of ``page_bytes``."""
    if len(pages) != num:
        raise ValueError(f"{num} hashes but {len(pages)} pages")
    for page in pages:
        if page.dtype != torch.uint8 or page.numel() != page_bytes or not page.is_contiguous():
            raise ValueError(
                f"a page must be a contiguous uint8 tensor of {page_bytes} bytes, "
                f"got {page.dtype} {tuple(page.shape)}"
            )


class KVTier(ABC):
    """One offload tier. Subclasses: HostTier, DiskTier, MooncakeTier.

    Capacity and eviction belong to the tier: ``prepare_store`` makes room by evicting the least
    recently used idle blocks, unpinned ones first, pinned ones last, in-flight ones never. A tier
    that cannot make room (everything in flight) or is unhealthy skips the block: it is simply
    not in the list ``prepare_store`` returns. Nothing here raises on a full or broken tier; the
    caller sees misses and skipped stores and recomputes.
    """

    name: str
    page_bytes: int
    record_evictions: bool = False  # set by a tiered store that demotes this tier's victims

    @property
    def healthy(self) -> bool:
        """False while the tier is known broken (its calls then miss and skip quickly)."""
        return True

    @abstractmethod
    def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Per hash: is the block present (stored, not in flight, not dropped)? No side
        effects. Engine thread."""

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading hashes present. Engine thread."""
        num = 0
        for present in self.contains(hashes):
            if not present:
                break
            num += 1
        return num

    @abstractmethod
    def prepare_store(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Reserve room for the hashes worth writing; return them, in order.

        Skips hashes already present or in flight, and those that do not fit. The returned ones
        are ``storing`` (invisible to lookups, never evicted) until ``complete_store``. May evict
        (see ``take_evicted``). Engine thread.
        """

    @abstractmethod
    def write(self, hashes: Sequence[BlockHash], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Copy ``pages`` into the reserved blocks; per hash, did it succeed? Never raises on
        I/O failure (returns False). ``hashes`` must all come from ``prepare_store``. Worker."""

    @abstractmethod
    def complete_store(self, hashes: Sequence[BlockHash], ok: Sequence[bool]) -> None:
        """End the stores: ``ok`` ones become present, the others are forgotten."""

    @abstractmethod
    def prepare_load(self, hashes: Sequence[BlockHash]) -> int:
        """Pin the leading present hashes for reading; return how many (a prefix of ``hashes``).

        A pinned block is never evicted until ``complete_load`` with the same prefix. Counts as a
        use for LRU. A shared tier whose store evicts on its own (Mooncake) may trust the
        caller's fresh lookup instead; its ``read`` then fails a block that vanished. Engine
        thread.
        """

    @abstractmethod
    def read(self, hashes: Sequence[BlockHash], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Copy the blocks into ``pages``; per hash, did it succeed? A block that cannot be
        trusted (checksum mismatch, vanished) is False, never wrong bytes. Worker thread."""

    @abstractmethod
    def complete_load(self, hashes: Sequence[BlockHash]) -> None:
        """Unpin the hashes that ``prepare_load`` pinned."""

    @abstractmethod
    def pin(self, hashes: Sequence[BlockHash]) -> None:
        """Soft pin: a hint that these blocks are evicted last (present or stored later)."""

    @abstractmethod
    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        """Undo ``pin``; unknown hashes are ignored."""

    @abstractmethod
    def drop(self, hashes: Sequence[BlockHash]) -> None:
        """Forget the blocks (and their pins); in-flight ones go when their transfer ends."""

    def take_evicted(self) -> list[EvictedBlock]:
        """Drain the blocks evicted since the last call, oldest first. Engine thread."""
        return []

    @abstractmethod
    def get_stats(self) -> TierStats:
        """A snapshot of the counters."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release resources (files stay on disk; the Mooncake client disconnects)."""
