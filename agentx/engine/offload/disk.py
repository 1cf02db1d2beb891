"""Disk tier: one file per block under a cache folder namespaced by a model/layout fingerprint.

Why one file per block rather than packed segments: a block page is large (tens of KB to MBs),
so a file per block costs little, and it buys simple correctness: a write is atomic (temp file,
then ``os.replace``), eviction frees space at once (``unlink``, no compaction), and a restart
rebuilds the index from a directory listing. Layout::

    <root>/<fingerprint slug>-<digest>/FINGERPRINT          the caller's fingerprint, verbatim
    <root>/<fingerprint slug>-<digest>/<hh>/<hash hex>.kv    hh = first hash byte (256 fan-out)

    file = header (48 bytes) + page (page_bytes)
    header = magic b"AXKV" | u16 version | u16 hash length | u64 page_bytes
             | blake2b-128 checksum of the page | block hash (16 bytes, zero-padded)

A block whose checksum, size or header does not match is a miss (the read fails and the file is
deleted), never wrong bytes. A write that fails (disk full: ENOSPC) skips the store with one
warning per episode. LRU order survives restarts through file mtimes (a load touches the file).
One process owns a folder at a time (the index lives in memory); two processes on one folder
stay safe, not efficient: a block the other deleted fails its read and is recomputed. Files are
not fsynced: after a crash a torn file fails its checksum, never serves wrong bytes.

Start-up never stops on a stray entry: a directory or a dangling link named like a block, a
leftover temp directory or an unreadable sub-folder is skipped with one warning and counted in
``num_skipped_entries``. A folder that cannot be used at all (``root`` names a file, or it cannot
be created or written) raises ``ConfigError`` naming it.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path

import torch

from agentx.engine.block_hash import BlockHash
from agentx.engine.offload.index import IndexedTier, IndexEntry
from agentx.errors import ConfigError

__all__ = ["DiskTier"]

logger = logging.getLogger(__name__)

_MAGIC = b"AXKV"
_VERSION = 1
_HEADER = struct.Struct("<4sHHQ16s16s")  # magic, version, hash length, page_bytes, sum, hash
_NAME = re.compile(r"^[0-9a-f]{2,32}\.kv$")


def _checksum(page: torch.Tensor) -> bytes:
    return hashlib.blake2b(page.numpy(), digest_size=16).digest()


def namespace_dir(root: str | os.PathLike, fingerprint: str) -> Path:
    """The folder of one model/layout fingerprint under ``root``."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", fingerprint)[:48].strip("_") or "kv"
    digest = hashlib.blake2b(fingerprint.encode(), digest_size=8).hexdigest()
    return Path(root) / f"{slug}-{digest}"


class DiskTier(IndexedTier):
    """Blocks as files under ``namespace_dir(root, fingerprint)``; capacity in bytes.

    ``fingerprint`` must change whenever the page layout or the model changes (the engine passes
    model id + dtype + block size + layer layout): a new process with the same fingerprint starts
    warm, a different one never reads foreign pages. Pages must be CPU tensors.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        fingerprint: str,
        page_bytes: int,
        capacity_bytes: int,
        name: str = "disk",
    ) -> None:
        super().__init__(name, page_bytes, capacity=capacity_bytes)
        self.folder = namespace_dir(root, fingerprint)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / "FINGERPRINT").write_text(fingerprint)
        except OSError as exc:
            raise ConfigError(
                f"offload.disk_path {os.fspath(root)!r} cannot hold the disk tier's cache "
                f"folder {self.folder}: {exc}"
            ) from exc
        self._pending_unlinks: list[Path] = []
        self._full = False  # inside a disk-full episode: warned once already
        self.num_skipped_entries = 0  # stray or unreadable entries ignored at start-up
        self._rebuild_index()

    @property
    def file_bytes(self) -> int:
        return _HEADER.size + self.page_bytes

    def path_of(self, block_hash: BlockHash) -> Path:
        hexed = block_hash.hex()
        return self.folder / hexed[:2] / f"{hexed}.kv"

    def _rebuild_index(self) -> None:
        found: list[tuple[int, BlockHash]] = []
        skipped: list[str] = []
        try:
            subs = sorted(self.folder.iterdir())
        except OSError as exc:
            raise ConfigError(
                f"disk tier: cannot list the cache folder {self.folder}: {exc}"
            ) from exc
        for sub in subs:
            if not sub.is_dir():
                continue
            for path in self._list(sub, skipped):
                try:
                    block = self._scan_entry(path)
                except OSError as exc:
                    skipped.append(f"{path} ({exc.strerror or exc})")
                    continue
                if block is not None:
                    found.append(block)
        if skipped:
            self.num_skipped_entries += len(skipped)
            logger.warning(
                "disk tier %s: skipped %d unreadable entries at start-up: %s",
                self.folder,
                len(skipped),
                "; ".join(skipped[:5]) + ("; ..." if len(skipped) > 5 else ""),
            )
        found.sort()
        with self._lock:
            for _, block_hash in found:
                entry, victims = self._index.reserve(block_hash, self.file_bytes)
                for victim_hash, victim in victims:
                    self._release(victim_hash, victim, evicted=True)
                if entry is not None:
                    entry.storing = False
            self._evicted.clear()
        self._flush_unlinks()

    @staticmethod
    def _list(folder: Path, skipped: list[str]) -> list[Path]:
        try:
            return sorted(folder.iterdir())
        except OSError as exc:
            skipped.append(f"{folder} ({exc.strerror or exc})")
            return []

    def _scan_entry(self, path: Path) -> tuple[int, BlockHash] | None:
        """(mtime, hash) of a good block file; None for a file to ignore. Deletes leftover temp
        files and wrong-sized blocks; raises OSError for what it cannot read or delete (a
        directory or a dangling link named like a block, a temp directory)."""
        if ".tmp" in path.name:  # a write that never finished (crash)
            path.unlink(missing_ok=True)
            return None
        if not _NAME.match(path.name):
            return None
        st = path.stat()  # follows links: a dangling one raises here
        if not path.is_file():
            raise IsADirectoryError(errno.EISDIR, "not a regular file")
        if st.st_size != self.file_bytes:
            path.unlink(missing_ok=True)
            return None
        return st.st_mtime_ns, bytes.fromhex(path.name[:-3])

    def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Present blocks; a block file another process wrote since (a shared cache folder) is
        adopted into the index when it is first asked for."""
        present = super().contains(hashes)
        if all(present):
            return present
        with self._lock:
            for i, block_hash in enumerate(hashes):
                if present[i] or block_hash in self._index.entries:
                    continue
                path = self.path_of(block_hash)
                if path in self._pending_unlinks:
                    continue  # dropped or found bad here: its deletion is on the way
                try:
                    if path.stat().st_size != self.file_bytes:
                        continue
                except OSError:
                    continue
                entry, victims = self._index.reserve(block_hash, self.file_bytes)
                for victim_hash, victim in victims:
                    self._release(victim_hash, victim, evicted=True)
                if entry is not None:
                    entry.storing = False
                    present[i] = True
        return present

    # --- IndexedTier hooks --------------------------------------------------------------------

    def _block_size(self) -> int:
        return self.file_bytes

    def _assign(self, block_hash: BlockHash, entry: IndexEntry) -> None:
        pass

    def _release(self, block_hash: BlockHash, entry: IndexEntry, evicted: bool) -> None:
        # unlinked by the worker before its next write; a re-store of the same hash is always
        # written after that (it is prepared after this release, and the worker is FIFO)
        self._pending_unlinks.append(self.path_of(block_hash))

    def _flush_unlinks(self) -> None:
        with self._lock:
            paths, self._pending_unlinks = self._pending_unlinks, []
        for path in paths:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                logger.warning("disk tier: cannot delete %s: %s", path, exc)

    def write(self, hashes: Sequence[BlockHash], pages: Sequence[torch.Tensor]) -> list[bool]:
        self._flush_unlinks()
        return super().write(hashes, pages)

    def _write_block(self, block_hash: BlockHash, entry: IndexEntry, page: torch.Tensor) -> bool:
        path = self.path_of(block_hash)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        header = _HEADER.pack(
            _MAGIC,
            _VERSION,
            len(block_hash),
            self.page_bytes,
            _checksum(page),
            block_hash.ljust(16, b"\0")[:16],
        )
        try:
            path.parent.mkdir(exist_ok=True)
            self._write_file(tmp, header, page)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if not self._full:
                self._full = True
                reason = "disk full" if exc.errno == errno.ENOSPC else "write failed"
                logger.warning(
                    "disk tier %s: %s (%s); skipping stores until a write succeeds",
                    self.folder,
                    reason,
                    exc,
                )
            return False
        self._full = False
        return True

    def _write_file(self, path: Path, header: bytes, page: torch.Tensor) -> None:
        """The raw file write (a seam for tests that inject OSError)."""
        with open(path, "wb") as f:
            f.write(header)
            f.write(memoryview(page.numpy()))

    def _read_block(self, block_hash: BlockHash, entry: IndexEntry, page: torch.Tensor) -> bool:
        path = self.path_of(block_hash)
        try:
            with open(path, "rb") as f:
                header = f.read(_HEADER.size)
                num = f.readinto(memoryview(page.numpy()))
                trailing = f.read(1)
            os.utime(path)  # LRU order survives restarts
        except OSError as exc:
            logger.warning("disk tier: cannot read %s: %s", path, exc)
            return False
        if len(header) != _HEADER.size or num != self.page_bytes or trailing:
            logger.warning("disk tier: %s has the wrong size; treated as a miss", path)
            return False
        magic, version, hash_len, page_bytes, checksum, stored_hash = _HEADER.unpack(header)
        ok = (
            magic == _MAGIC
            and version == _VERSION
            and page_bytes == self.page_bytes
            and stored_hash[:hash_len] == block_hash[:16]
            and checksum == _checksum(page)
        )
        if not ok:
            logger.warning("disk tier: %s failed its checksum; treated as a miss", path)
        return ok

    def close(self) -> None:
        self._flush_unlinks()

    def check_integrity(self) -> None:
        super().check_integrity()
        with self._lock:
            assert self._index.used == len(self._index.entries) * self.file_bytes
