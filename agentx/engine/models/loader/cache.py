"""The engine's own weight format: a read checkpoint kept under ``AGENTX_CACHE_DIR``, mmapped.

Reading a GGUF file is slow in Python (the tokenizer's ~100K strings are parsed one by one, and
float weights are dequantized), so the first load writes the :class:`Checkpoint` it produced
(spec, tokenizer, tensors: float ones and the exact integers of quantized ones) to
``<cache>/checkpoints/<key>.pt``; later processes memory-map it and skip the GGUF reader. The key
covers the file (resolved path, size, modification time), the load options and ``FORMAT``, so a
changed file or a new format never reads a stale entry. Writes go to a temporary name and are
renamed into place; an unreadable entry is deleted and rebuilt. A GGUF whose large matrices are
all kept as the file's K-quant blocks is not cached: they are views of the mapped file, so
reading it again is as fast as the entry would be (Qwen2.5-Coder-1.5B: Engine() 0.9 s either
way, against 2.6 s more to write its 1 GB entry). Entries are pickles (the spec and
tokenizer are Python objects), so the cache folder must be as trusted as the code: it is the
user's own ``AGENTX_CACHE_DIR``, written only by agentx.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from agentx import env

__all__ = ["FORMAT", "cached", "entry_path"]

FORMAT = 2  # bump when Checkpoint, QuantizedTensor or a loader's output changes
_log = logging.getLogger(__name__)


def entry_path(path: Path, options: str) -> Path:
    stat = path.stat()
    key = f"{FORMAT}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{options}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return env.cache_dir() / "checkpoints" / f"{path.stem}-{digest}.pt"


def cached(
    path: Path,
    options: str,
    read: Callable[[], object],
    worth_writing: Callable[[object], bool] = lambda _: True,
) -> object:
    """``read()``'s checkpoint for ``path`` and ``options``, from the cache when it is there;
    a new one is written unless ``worth_writing(checkpoint)`` says reading it again is as
    cheap (its tensors are views of the file's own bytes)."""
    entry = entry_path(path, options)
    if entry.is_file():
        try:
            return torch.load(entry, mmap=True, weights_only=False)
        except Exception as exc:  # a truncated or foreign file: rebuild it
            _log.warning("agentx: dropping unreadable cached checkpoint %s (%s)", entry, exc)
            entry.unlink(missing_ok=True)
    checkpoint = read()
    if worth_writing(checkpoint):
        _write(entry, checkpoint)
    return checkpoint


def _write(entry: Path, checkpoint: object) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, suffix=".tmp")
        os.close(fd)
        try:
            torch.save(checkpoint, tmp)
            os.replace(tmp, entry)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError as exc:  # a read-only or full cache folder costs speed, not correctness
        _log.warning("agentx: could not cache the checkpoint in %s (%s)", entry.parent, exc)
