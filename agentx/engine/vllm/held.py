"""HeldHandles: the vLLM backend's held-KV handles, bookkeeping over vLLM's prefix cache.

vLLM keeps no per-request KV after a request finishes; its automatic prefix cache keeps whole
blocks until they are evicted (LRU). A handle here names a finished turn a later request may
continue; what it buys is the prefix cache's hit, reported by vLLM's ``num_cached_tokens``. Each
handle carries its session lineage (the id of the session's first request), which a fork
inherits: the key for sticky data-parallel routing. Thread-safe; releases are queued without
a lock (a garbage collector's finalizer queues them).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

__all__ = ["HeldHandles"]


class HeldHandles:
    def __init__(self) -> None:
        self._lineage: dict[str, str] = {}  # handle -> session lineage
        self._releases: deque[str] = deque()
        self._lock = threading.Lock()

    def hold(self, handle: str, lineage: str) -> None:
        with self._lock:
            self._lineage[handle] = lineage

    def adopt(self, handle: str | None) -> None:
        """A request continuing ``handle`` started: the hold passes to it."""
        if handle is not None:
            with self._lock:
                self._lineage.pop(handle, None)

    def lineage_of(self, handle: str | None, default: str) -> str:
        with self._lock:
            return self._lineage.get(handle, default) if handle is not None else default

    def fork(self, handle: str, new_handles: list[str]) -> bool:
        """Hold ``new_handles`` on ``handle``'s lineage; False if ``handle`` is not held."""
        with self._lock:
            self._apply_releases()
            lineage = self._lineage.get(handle)
            if lineage is None:
                return False
            for new in new_handles:
                self._lineage[new] = lineage
            return True

    def release_eventually(self, handle: str) -> None:
        self._releases.append(handle)  # deque.append is atomic: never blocks

    def __len__(self) -> int:
        with self._lock:
            self._apply_releases()
            return len(self._lineage)

    def _apply_releases(self) -> None:
        while self._releases:
            self._lineage.pop(self._releases.popleft(), None)

    def check_integrity(self, live_request_ids: Iterable[str]) -> None:
        with self._lock:
            self._apply_releases()
            both = set(self._lineage) & set(live_request_ids)
            assert not both, f"live requests are also held: {sorted(both)}"
