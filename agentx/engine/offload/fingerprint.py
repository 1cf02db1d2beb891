"""What a KV page means, as a short id: the tiers are namespaced by it.

Block hashes cover tokens only, so a page is only valid for the weights, dtype, quantization
and page layout that wrote it. The fingerprint keys on the checkpoint's bytes, never on the
path string (other weights saved at the same path must never read these pages), and on the
layout without the pool's block count, so engines with different pool sizes share their
tiers.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

from agentx import env
from agentx.engine.kv_cache import KVCacheLayout

__all__ = ["checkpoint_digest", "layout_fingerprint", "page_fingerprint"]

_CHUNK_BYTES = 8 << 20
_MEMO_MIN_BYTES = 64 << 20
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")


def checkpoint_digest(path: str | os.PathLike) -> str:
    """A digest of a checkpoint file's (or a folder's weight files') whole contents.

    Hashing reads every byte (~0.2 s per 100 MB), so a large file's digest is kept in the
    cache folder under its identity (path, size, mtime, inode): computed once per version."""
    path = Path(path).resolve()
    files = (
        [path]
        if path.is_file()
        else sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    )
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        digest.update(f"{file.name}:{_file_digest(file)}\n".encode())
    return digest.hexdigest()


def _file_digest(file: Path) -> str:
    stat = file.stat()
    if stat.st_size < _MEMO_MIN_BYTES:  # hashed in ~0.1 s: no memo to go stale
        return _hash_file(file)
    identity = f"{file}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    memo = (
        env.cache_dir() / "digests" / hashlib.blake2b(identity.encode(), digest_size=16).hexdigest()
    )
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    value = _hash_file(file)
    try:  # written whole, then renamed: a reader never sees half a digest
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(value)
        os.replace(tmp, memo)
    except OSError:
        pass  # a read-only cache folder: hashed again next time
    return value


def layout_fingerprint(*parts: object) -> str:
    """A short stable id of ``parts`` (what a page means)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


def page_fingerprint(
    weights_digest: str, dtype: str, quantization: str, layout: KVCacheLayout, architecture: str
) -> str:
    """The tiers' namespace for an engine: the layout counts without its block count."""
    return layout_fingerprint(
        weights_digest, dtype, quantization, replace(layout, num_blocks=0), architecture
    )


def _hash_file(file: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
