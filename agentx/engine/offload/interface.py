"""Offload: what the engine core calls on its offload tiers, every step and per held KV.

Two implementations: ``OffloadManager`` (manager.py) drives the tiered store; ``NullOffload``
(here) is the engine's offload when no tier is configured: the same interface, doing nothing,
so the core never asks whether it has tiers. Every method runs on the engine thread, with the
step held; none raises for a tier fault (a failed load is recomputed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from agentx.engine.block_hash import BlockHash
from agentx.engine.kv_cache.block_pool import KVBlock
from agentx.engine.request import Request


@dataclass(frozen=True, slots=True)
class KVExport:
    """A session's prefix as another engine can import it from a shared tier.

    With a tail (``export(handle, include_tail=True)``) each KV group's last page that no
    prefix hash names travels too: a partial last block (attention groups), the running state
    (linear-state groups, also at a block boundary), stored under the group's key of
    ``tail_key`` (no prefix-cache hash is ever equal to it), so the importer resumes at the
    exact token the exporter stopped at, in every layout::

        token_ids   [ block 0 | block 1 | ... | block n-1 ][ tail_token_ids ]
        tier keys     block_hashes[0 .. n-1]                 tail_key (per group)
    """

    token_ids: tuple[int, ...]  # the tokens of the exported full blocks
    block_hashes: tuple[BlockHash, ...]
    tail_token_ids: tuple[int, ...] = ()  # the partial last block's tokens (may be empty)
    tail_key: BlockHash | None = None  # None: no tail, the importer resumes at a boundary
    cache_salt: bytes = b""  # the salt of the exported KV: only requests with it extend it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + len(self.tail_token_ids)


class Offload(ABC):
    @abstractmethod
    def on_request(self, request: Request) -> bool:
        """A new request: start loading its prefix from the tiers; True if the core must park
        it until the load is ready (``poll`` / ``take_ready``)."""

    @abstractmethod
    def poll(self) -> list[tuple[str, str]]:
        """Drain finished transfers; (request id, held-KV handle) of parked requests whose
        prefix is loaded (as that held KV)."""

    @abstractmethod
    def take_ready(self) -> list[tuple[str, str]]:
        """Loads that finished outside ``poll`` (a flush), in the same form."""

    @abstractmethod
    def after_step(self) -> None:
        """The step's KV is written: store what it published, act on finished turns' hints."""

    @abstractmethod
    def idle_wait(self, timeout: float = 0.005) -> None:
        """Nothing to schedule: wait a little for a transfer instead of spinning."""

    @abstractmethod
    def has_pending(self) -> bool:
        """Transfers or prefetches are due: the engine loop must keep stepping."""

    @abstractmethod
    def on_release(self, handle: str, drop_cached: bool) -> None:
        """Held KV ``handle`` is about to be released (its blocks are still there): forget its
        prefetch; ``drop_cached`` also drops its blocks from every tier."""

    @abstractmethod
    def pin(self, handle: str, pinned: bool) -> None:
        """Soft-pin (or unpin) held KV's blocks in every tier."""

    @abstractmethod
    def export(self, handle: str, include_tail: bool = False) -> KVExport | None:
        """Held KV's prefix as another engine sharing a tier can import it; None if unknown.
        ``include_tail``: each group's last page goes to the tiers too, so the importer
        resumes at the exact token (a P/D hand-over)."""

    @abstractmethod
    def import_(self, export: KVExport, handle: str) -> int:
        """Load an exported prefix as held KV ``handle``; returns its tokens on the device."""

    @abstractmethod
    def flush(self, timeout: float = 30.0) -> None:
        """Wait (up to ``timeout`` seconds) until every queued transfer has landed and apply
        the finished ones; parked requests whose load finished go to ``take_ready``."""

    @abstractmethod
    def get_stats(self) -> dict[str, int]:
        """``EngineStats`` fields (``offload_*``)."""

    @abstractmethod
    def get_referenced_blocks(self) -> list[KVBlock]:
        """Device blocks the transfers in flight reference (a load's hit prefix and the blocks
        its pages land in), once per reference: no request or held KV owns them yet."""

    @abstractmethod
    def check_integrity(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class NullOffload(Offload):
    """No tiers: nothing loads, stores or prefetches."""

    def on_request(self, request: Request) -> bool:
        return False

    def poll(self) -> list[tuple[str, str]]:
        return []

    def take_ready(self) -> list[tuple[str, str]]:
        return []

    def after_step(self) -> None:
        pass

    def idle_wait(self, timeout: float = 0.005) -> None:
        pass

    def has_pending(self) -> bool:
        return False

    def on_release(self, handle: str, drop_cached: bool) -> None:
        pass

    def pin(self, handle: str, pinned: bool) -> None:
        pass

    def export(self, handle: str, include_tail: bool = False) -> KVExport | None:
        return None

    def import_(self, export: KVExport, handle: str) -> int:
        return 0

    def flush(self, timeout: float = 30.0) -> None:
        pass

    def get_stats(self) -> dict[str, int]:
        return {}

    def get_referenced_blocks(self) -> list[KVBlock]:
        return []

    def check_integrity(self) -> None:
        pass

    def close(self) -> None:
        pass
