"""Mooncake Store tier: blocks in a Mooncake distributed pool shared across engine processes.

Each tier is a Mooncake store client (``MooncakeDistributedStore``, P2P handshake, TCP) that
contributes ``segment_bytes`` of its memory to the pool and talks to one ``mooncake_master``.
Keys are ``agentx/<fingerprint digest>/<block hash hex>``, so two engines with the same model
and layout share prefixes. The master owns presence, capacity and eviction (its own LRU with
high-watermark eviction; objects being read are protected by its leases); this tier keeps only
its in-flight sets. Soft pin: a block stored while pinned is put with Mooncake's soft pin (the
master evicts it last); pinning a block already in the store does not re-pin it (the client
API fixes pins at put time), it is only remembered for later puts.

Faults never hang the engine: every client call runs on a helper thread with a timeout. A
timeout, an RPC failure or an unreachable master marks the tier unhealthy; while unhealthy,
lookups miss and stores are skipped at once, and every ``retry_interval_s`` a cheap TCP probe
(then the client's health check, or a fresh ``setup``) tries to bring it back. Objects do not
survive a master restart (the master's metadata is in memory): they are misses afterwards.

Every object is the page followed by a checksum of its key and bytes (``_CHECKSUM_BYTES``): a
read whose checksum does not match (bytes damaged in the pool, or stored under another key) is
a miss, never KV. A put that timed out may still be reading the staging rows, so nothing new is
copied into them until it returns (the tier is unhealthy meanwhile).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from agentx.engine.block_hash import BlockHash
from agentx.engine.offload.base import KVTier, TierStats, check_pages
from agentx.engine.offload.mooncake_master import has_private_network, port_is_open
from agentx.errors import ConfigError, OffloadError

__all__ = ["MooncakeTier"]

logger = logging.getLogger(__name__)

_RPC_FAIL = -900  # the master did not answer
_NOT_INITIALIZED = -600
_ALREADY_EXISTS = -706  # (this version answers 0 to a put of an existing key: also fine)
_MIN_SEGMENT_BYTES = 16 << 20  # the client refuses smaller segments
_CHECKSUM_BYTES = 16


def _checksum(key: str, page: torch.Tensor) -> bytes:
    """blake2b of the object's key and its page bytes."""
    digest = hashlib.blake2b(key.encode(), digest_size=_CHECKSUM_BYTES)
    digest.update(page.numpy().data)
    return digest.digest()


class MooncakeTier(KVTier):
    """Blocks in Mooncake Store through the master at ``master_address`` (``host:port``)."""

    def __init__(
        self,
        master_address: str,
        page_bytes: int,
        fingerprint: str,
        segment_bytes: int = 64 << 20,
        staging_blocks: int = 16,
        timeout_s: float = 2.0,
        lookup_timeout_s: float = 0.5,
        retry_interval_s: float = 1.0,
        local_hostname: str = "127.0.0.1",
        name: str = "mooncake",
        allow_network: bool = False,
    ) -> None:
        if not allow_network and not has_private_network():
            raise OffloadError(
                "refusing to start a Mooncake client outside a private network namespace (it "
                "binds every interface); run under unshare -n, or set allow_network"
            )
        if segment_bytes < _MIN_SEGMENT_BYTES:
            raise ConfigError(f"a Mooncake segment needs at least 16 MiB, got {segment_bytes}")
        if page_bytes + _CHECKSUM_BYTES > segment_bytes:
            raise ConfigError(f"page_bytes {page_bytes} exceeds the segment ({segment_bytes})")
        self.name = name
        self.page_bytes = page_bytes
        self.master_address = master_address
        self.segment_bytes = segment_bytes
        self.timeout_s = timeout_s
        self.lookup_timeout_s = lookup_timeout_s
        self.retry_interval_s = retry_interval_s
        self.local_hostname = local_hostname
        digest = hashlib.blake2b(fingerprint.encode(), digest_size=8).hexdigest()
        self.key_prefix = f"agentx/{digest}/"
        # the worker's staging rows: Mooncake reads/writes only registered memory
        self.object_bytes = page_bytes + _CHECKSUM_BYTES  # (page | checksum)
        self._staging = torch.zeros((staging_blocks, self.object_bytes), dtype=torch.uint8)
        self._meta = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-meta")  # engine side
        self._data = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-data")  # worker side
        self._probe = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-probe")  # reconnects
        self._last: dict[ThreadPoolExecutor, Future] = {}
        self._probing: Future | None = None
        self._lock = threading.Lock()
        self._store = None
        self._healthy = False
        self._next_retry = 0.0
        self._storing: set[BlockHash] = set()
        self._loading: Counter[BlockHash] = Counter()
        self._pinned: set[BlockHash] = set()
        self._counts = dict(stored=0, loaded=0, failed=0, corrupt=0)
        self._closed = False
        self._warned_setup = False
        self._reconnect()  # synchronous once (bounded), so a reachable master is used at once

    def key(self, block_hash: BlockHash) -> str:
        return self.key_prefix + block_hash.hex()

    # --- health -------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """False while broken; then, at most every ``retry_interval_s``, a reconnect attempt is
        started in the background (the caller never waits for it)."""
        if self._healthy or self._closed or time.monotonic() < self._next_retry:
            return self._healthy
        if self._probing is None or self._probing.done():
            self._next_retry = time.monotonic() + self.retry_interval_s
            self._probing = self._probe.submit(self._reconnect)
        return self._healthy

    def _mark_unhealthy(self, why: str) -> None:
        if self._healthy:
            logger.warning("mooncake tier %s unhealthy (%s); skipping it", self.name, why)
        self._healthy = False
        self._next_retry = time.monotonic() + self.retry_interval_s

    def _reconnect(self) -> None:
        self._next_retry = time.monotonic() + self.retry_interval_s
        host, _, port = self.master_address.rpartition(":")
        if not port_is_open(host, int(port), timeout=min(0.3, self.timeout_s)):
            return
        if self._store is None:
            # a reachable master answers setup in milliseconds; an absent one makes it retry
            # for ~90 s, hence the port probe above and the timeout here
            store = self._call(self._meta, self._setup, timeout=max(self.timeout_s, 5.0))
            if store is None:
                if not self._warned_setup:
                    self._warned_setup = True
                    logger.warning(
                        "mooncake tier %s: cannot set up a client of %s; retrying every %.1fs",
                        self.name, self.master_address, self.retry_interval_s,
                    )  # fmt: skip
                return
            self._store = store
        elif self._call(self._meta, self._store.health_check) != 0:
            return
        if not self._healthy:
            logger.info("mooncake tier %s connected to %s", self.name, self.master_address)
        self._healthy = True

    def _setup(self):
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup(
            self.local_hostname, "P2PHANDSHAKE", self.segment_bytes, 16 << 20, "tcp", "",
            self.master_address,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        ptr, size = self._staging.data_ptr(), self._staging.numel()
        if store.register_buffer(ptr, size) != 0:
            raise RuntimeError("register_buffer failed")
        return store

    def _is_stuck(self, pool: ThreadPoolExecutor) -> bool:
        """An earlier call on ``pool`` timed out and has not returned yet."""
        last = self._last.get(pool)
        if last is not None and not last.done():
            self._mark_unhealthy("an earlier call is still stuck")
            return True
        return False

    def _call(self, pool: ThreadPoolExecutor, fn: Callable, *args, timeout: float | None = None):
        """Run one client call on ``pool`` with a timeout; None (and unhealthy) on failure.

        A call still stuck from an earlier timeout blocks the pool: then nothing new is queued
        behind it (the tier stays unhealthy until it returns)."""
        if self._is_stuck(pool):
            return None
        try:
            future = self._last[pool] = pool.submit(fn, *args)
            return future.result(timeout or self.timeout_s)
        except FutureTimeout:
            self._mark_unhealthy(f"{getattr(fn, '__name__', fn)} timed out")
        except Exception as exc:  # noqa: BLE001  (a broken client is an unhealthy tier)
            self._mark_unhealthy(f"{getattr(fn, '__name__', fn)}: {exc!r}")
        return None

    def _check_codes(self, codes) -> list[int] | None:
        if codes is None:
            return None
        if any(c in (_RPC_FAIL, _NOT_INITIALIZED) for c in codes):
            self._mark_unhealthy(f"master unreachable (code {min(codes)})")
            return None
        return list(codes)

    # --- KVTier -------------------------------------------------------------------------------

    def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        if not hashes or not self.healthy:
            return [False] * len(hashes)
        keys = [self.key(h) for h in hashes]
        codes = self._call(
            self._meta, self._store.batch_is_exist, keys, timeout=self.lookup_timeout_s
        )
        codes = self._check_codes(codes)
        if codes is None:
            return [False] * len(hashes)
        with self._lock:
            return [c == 1 and h not in self._storing for c, h in zip(codes, hashes, strict=True)]

    def prepare_store(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        present = self.contains(hashes)
        if not self._healthy:
            return []
        out = []
        with self._lock:
            for block_hash, there in dict(zip(hashes, present, strict=True)).items():
                if not there and block_hash not in self._storing:
                    out.append(block_hash)
            self._storing.update(out)
        return out

    def write(self, hashes: Sequence[BlockHash], pages: Sequence[torch.Tensor]) -> list[bool]:
        check_pages(pages, len(hashes), self.page_bytes)
        from mooncake.store import ReplicateConfig, SoftPinAction

        out = []
        for start in range(0, len(hashes), len(self._staging)):
            chunk = hashes[start : start + len(self._staging)]
            # a timed-out put may still read the staging rows: never overwrite them under it
            if not self._healthy or self._is_stuck(self._data):
                out.extend([False] * len(chunk))
                continue
            for i, page in enumerate(pages[start : start + len(chunk)]):
                row = self._staging[i]
                row[: self.page_bytes].copy_(page.view(-1))
                checksum = _checksum(self.key(chunk[i]), row[: self.page_bytes])
                row[self.page_bytes :].copy_(torch.tensor(list(checksum), dtype=torch.uint8))
            ok = [False] * len(chunk)
            with self._lock:
                pinned = [i for i, h in enumerate(chunk) if h in self._pinned]
            for soft_pin in (False, True):
                idx = [i for i in range(len(chunk)) if (i in pinned) == soft_pin]
                if not idx:
                    continue
                config = ReplicateConfig()
                if soft_pin:
                    config.soft_pin_action = SoftPinAction.ENABLE
                codes = self._check_codes(
                    self._call(
                        self._data, self._store.batch_put_from,
                        [self.key(chunk[i]) for i in idx],
                        [self._staging[i].data_ptr() for i in idx],
                        [self.object_bytes] * len(idx), config,
                    )
                )  # fmt: skip
                for i, code in zip(idx, codes or [-1] * len(idx), strict=True):
                    ok[i] = code in (0, _ALREADY_EXISTS)
            out.extend(ok)
        return out

    def complete_store(self, hashes: Sequence[BlockHash], ok: Sequence[bool]) -> None:
        with self._lock:
            for block_hash, good in zip(hashes, ok, strict=True):
                self._storing.remove(block_hash)
                self._counts["stored" if good else "failed"] += 1

    def prepare_load(self, hashes: Sequence[BlockHash]) -> int:
        """Trusts the caller's fresh lookup (no second RPC): a block evicted in between makes
        its read fail, and the engine recomputes it."""
        if not self.healthy:
            return 0
        with self._lock:
            self._loading.update(hashes)
        return len(hashes)

    def read(self, hashes: Sequence[BlockHash], pages: Sequence[torch.Tensor]) -> list[bool]:
        check_pages(pages, len(hashes), self.page_bytes)
        out = []
        for start in range(0, len(hashes), len(self._staging)):
            chunk = hashes[start : start + len(self._staging)]
            if not self._healthy:
                out.extend([False] * len(chunk))
                continue
            codes = self._check_codes(
                self._call(
                    self._data, self._store.batch_get_into,
                    [self.key(h) for h in chunk],
                    [self._staging[i].data_ptr() for i in range(len(chunk))],
                    [self.object_bytes] * len(chunk),
                )
            )  # fmt: skip
            ok = [c == self.object_bytes for c in codes or [-1] * len(chunk)]
            for i, good in enumerate(ok):
                ok[i] = good and self._verify(chunk[i], self._staging[i])
                if ok[i]:
                    pages[start + i].view(-1).copy_(self._staging[i][: self.page_bytes])
            out.extend(ok)
        return out

    def _verify(self, block_hash: BlockHash, row: torch.Tensor) -> bool:
        """The staged object's checksum matches its key and page (else it is a miss)."""
        key = self.key(block_hash)
        good = _checksum(key, row[: self.page_bytes]) == bytes(row[self.page_bytes :].numpy())
        if not good:
            logger.warning("mooncake tier %s: %s failed its checksum; a miss", self.name, key)
            with self._lock:
                self._counts["corrupt"] += 1
        return good

    def complete_load(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            for block_hash in hashes:
                assert self._loading[block_hash] > 0, f"{block_hash.hex()} was not loading"
                self._loading[block_hash] -= 1
                if not self._loading[block_hash]:
                    del self._loading[block_hash]
                self._counts["loaded"] += 1

    def pin(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            self._pinned.update(hashes)

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            self._pinned.difference_update(hashes)

    def drop(self, hashes: Sequence[BlockHash]) -> None:
        """Remove the blocks from the shared store (for every engine: release is global).

        Not forced: a block read within the master's lease TTL (default 10 s) stays until the
        lease ends, so a concurrent reader in another engine never sees it freed under it.
        """
        self.unpin(hashes)
        if hashes and self.healthy:
            keys = [self.key(h) for h in hashes]
            codes = self._call(self._meta, self._store.batch_remove, keys, timeout=self.timeout_s)
            self._check_codes(codes)

    def get_stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                name=self.name,
                num_blocks=-1,  # unknown: the pool is shared and the master evicts
                used=-1,
                capacity=self.segment_bytes,
                num_pinned=len(self._pinned),
                num_in_flight=len(self._storing) + len(self._loading),
                num_stored=self._counts["stored"],
                num_loaded=self._counts["loaded"],
                num_evicted=0,
                num_failed=self._counts["failed"],
                healthy=self._healthy,
            )

    def check_integrity(self) -> None:
        with self._lock:
            assert all(n > 0 for n in self._loading.values()), "a non-positive load count"
            assert not set(self._loading) & self._storing, "a block both loading and storing"

    def close(self, wait: bool = False) -> None:
        """Disconnect (the blocks in this client's segment leave the pool with it). The client's
        own close takes ~2 s (it unmounts its segment), so by default it finishes in the
        background; the interpreter waits for it at exit."""
        self._closed = True
        store, self._store, self._healthy = self._store, None, False
        if store is not None:
            done = self._data.submit(store.close)
            if wait:
                done.result(max(self.timeout_s, 5.0))
        self._meta.shutdown(wait=False, cancel_futures=True)
        self._probe.shutdown(wait=False, cancel_futures=True)
        self._data.shutdown(wait=False)
