"""Building a tokenizer from GGUF ``tokenizer.ggml.*`` metadata, and caching what was built.

A GGUF file carries no ``tokenizer.json``: only tokens, merges (or scores) and token types. A
byte-level BPE (``tokenizer.ggml.model`` "gpt2") is rebuilt from them, with the pre-tokenizer
llama.cpp uses for ``tokenizer.ggml.pre`` (the split the merges were learned on); a SentencePiece
BPE ("llama": Gemma) becomes a BPE over ``▁``-spelled text with merges derived from the scores.
Building takes seconds, so a built tokenizer is kept in process and on disk under
``<cache_dir>/tokenizers/``, keyed by the file's path, mtime and size.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from agentx import env
from agentx.engine.models.loader.gguf_file import GGUFFile
from agentx.engine.models.tokenizer import _CACHE_FORMAT, Tokenizer
from agentx.errors import ModelLoadError

__all__ = ["cached_gguf_tokenizer", "clear_tokenizer_cache", "open_gguf"]

logger = logging.getLogger(__name__)

_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_SPACE = "\u2581"  # SentencePiece's visible space


# --- building from GGUF metadata ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _PreTokenizerRecipe:
    """How llama.cpp splits text before BPE for one ``tokenizer.ggml.pre`` family."""

    regex: str | None = None  # None: ByteLevel's built-in GPT-2 regex
    # Every digit its own piece before the regex runs (StarCoder / SmolLM). llama.cpp splits on
    # \p{N}; the Digits pre-tokenizer of the original tokenizer.json uses Rust's is_numeric.
    isolate_digits: bool = False
    ignore_merges: bool = False  # a whole pre-token found in the vocab is taken as is (Llama 3)
    add_bos: bool = False  # the default when the file has no tokenizer.ggml.add_bos_token

    def build(self) -> pre_tokenizers.PreTokenizer:
        if self.regex is None:
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            if not self.isolate_digits:
                return byte_level
            return pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(self.regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )


_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = _PreTokenizerRecipe()
_STARCODER = _PreTokenizerRecipe(isolate_digits=True)
_LLAMA3 = _PreTokenizerRecipe(_LLAMA3_REGEX, ignore_merges=True, add_bos=True)
_QWEN2 = _PreTokenizerRecipe(_QWEN2_REGEX)

# tokenizer.ggml.pre -> recipe; a missing or unknown value falls back to GPT-2 (llama.cpp's
# "default"), with a warning for an unknown one.
_PRE_TOKENIZERS = {
    "default": _GPT2,
    "gpt2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "smollm": _STARCODER,
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "codeshell": _STARCODER,
    "command-r": _STARCODER,
    "exaone": _STARCODER,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "falcon3": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}


def _build_from_gguf(reader: GGUFFile) -> Tokenizer:
    model = _gguf_value(reader, "tokenizer.ggml.model")
    builders = {"gpt2": _build_byte_level_bpe, "llama": _build_sentencepiece_bpe}
    if model not in builders:
        raise ModelLoadError(
            f"GGUF tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' or "
            "SentencePiece BPE 'llama')"
        )
    return builders[model](reader)


def _build_byte_level_bpe(reader: GGUFFile) -> Tokenizer:
    tokens: list[str] = _gguf_value(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = _gguf_value(reader, "tokenizer.ggml.token_type") or []
    merges: list[str] = _gguf_value(reader, "tokenizer.ggml.merges") or []
    recipe = _pre_tokenizer_recipe(_gguf_value(reader, "tokenizer.ggml.pre"))
    try:
        bpe = models.BPE(
            {token: token_id for token_id, token in enumerate(tokens)},
            [tuple(merge.split(" ", 1)) for merge in merges],
            ignore_merges=recipe.ignore_merges,
        )
    except Exception as exc:  # the Rust side raises plain Exception (a merge out of vocabulary)
        raise ModelLoadError(f"GGUF vocabulary and merges do not fit together: {exc}") from exc
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = recipe.build()
    backend.decoder = decoders.ByteLevel()
    _add_gguf_special_tokens(backend, tokens, token_types)
    add_bos = _gguf_value(reader, "tokenizer.ggml.add_bos_token")
    return _wrap(reader, backend, recipe.add_bos if add_bos is None else bool(add_bos))


def _build_sentencepiece_bpe(reader: GGUFFile) -> Tokenizer:
    """SentencePiece BPE as a ``tokenizers`` BPE: spaces become ``▁`` (plus one in front when
    ``add_space_prefix``), the whole text is one word, unknown bytes fall back to ``<0xNN>``.

    SentencePiece merges the adjacent pair whose joined piece ranks best; a BPE applies the
    lowest-ranked merge. So every split of a token into two vocabulary pieces is a merge, ranked
    by the token's place in the file (then the longer left piece first). The place is the rank:
    normal tokens' scores fall with it, while the user-defined space runs carry a placeholder
    score (-1000) but merge at their place, as transformers' Gemma tokenizer does. Those runs
    are stored as real spaces where the text holds ``▁``, so they are respelled.
    """
    tokens = [
        _SPACE * len(t) if t and not t.strip(" ") else t
        for t in _gguf_value(reader, "tokenizer.ggml.tokens")
    ]
    token_types: list[int] = _gguf_value(reader, "tokenizer.ggml.token_type")
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    merges = []
    for token, kind in zip(tokens, token_types, strict=True):
        if kind not in (_TOKEN_TYPE_NORMAL, _TOKEN_TYPE_USER_DEFINED):
            continue
        for cut in range(len(token) - 1, 0, -1):
            if token[:cut] in vocab and token[cut:] in vocab:
                merges.append((token[:cut], token[cut:]))
    unk = _gguf_value(reader, "tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab,
        merges,
        unk_token=None if unk is None else tokens[unk],
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = tokenizers.Tokenizer(bpe)
    prefix = _gguf_value(reader, "tokenizer.ggml.add_space_prefix")
    replace = normalizers.Replace(" ", _SPACE)
    to_space = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix is None or prefix:  # llama.cpp's default for SentencePiece
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace])
        backend.decoder = decoders.Sequence([*to_space, decoders.Strip(" ", 1, 0)])
    else:
        backend.normalizer = replace
        backend.decoder = decoders.Sequence(to_space)
    # the respelled space runs are vocabulary pieces now, not text to match whole
    kinds = [
        _TOKEN_TYPE_NORMAL if t.startswith(_SPACE) else kind
        for t, kind in zip(tokens, token_types, strict=True)
    ]
    _add_gguf_special_tokens(backend, tokens, kinds)
    add_bos = _gguf_value(reader, "tokenizer.ggml.add_bos_token")
    return _wrap(reader, backend, True if add_bos is None else bool(add_bos))


def _wrap(reader: GGUFFile, backend: tokenizers.Tokenizer, add_bos: bool) -> Tokenizer:
    return Tokenizer(
        backend,
        bos_token_id=_gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_gguf_value(reader, "tokenizer.ggml.eos_token_id"),
        add_bos=add_bos,
        chat_template=_gguf_value(reader, "tokenizer.chat_template"),
    )


def _pre_tokenizer_recipe(pre: str | None) -> _PreTokenizerRecipe:
    recipe = _PRE_TOKENIZERS.get(pre or "default")
    if recipe is None:
        logger.warning("unknown tokenizer.ggml.pre %r; splitting text the GPT-2 way", pre)
        return _GPT2
    return recipe


def _add_gguf_special_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], token_types: list[int]
) -> None:
    """Control tokens become special added tokens and user-defined ones plain added tokens, so
    both are matched whole in text (as llama.cpp does); each keeps its id from the vocabulary."""
    kinds = dict(zip(tokens, token_types, strict=False))  # token_type may be absent: no kinds
    control = [t for t, kind in kinds.items() if kind == _TOKEN_TYPE_CONTROL]
    user = [t for t, kind in kinds.items() if kind == _TOKEN_TYPE_USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _gguf_value(reader: GGUFFile, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def open_gguf(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file: {exc}") from exc


# --- the GGUF tokenizer cache --------------------------------------------------------------------


class _FileKey(NamedTuple):
    path: str
    mtime_ns: int
    size: int

    def digest(self) -> str:
        text = f"{self.path}|{self.mtime_ns}|{self.size}|{_CACHE_FORMAT}"
        return hashlib.sha256(text.encode()).hexdigest()[:32]


_memory_cache: dict[_FileKey, Tokenizer] = {}
_memory_lock = threading.Lock()


def clear_tokenizer_cache() -> None:
    """Forget the in-process cache of GGUF tokenizers (the files on disk stay)."""
    with _memory_lock:
        _memory_cache.clear()


def cached_gguf_tokenizer(path: Path, open_reader: Callable[[], GGUFFile]) -> Tokenizer:
    stat = path.stat()
    key = _FileKey(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    with _memory_lock:
        hit = _memory_cache.get(key)
    if hit is not None:
        return hit
    file = env.cache_dir() / "tokenizers" / f"{key.digest()}.json"
    tokenizer = _read_cache_file(file)
    if tokenizer is None:
        tokenizer = _build_from_gguf(open_reader())
        _write_cache_file(file, tokenizer)
    with _memory_lock:
        return _memory_cache.setdefault(key, tokenizer)


def _read_cache_file(file: Path) -> Tokenizer | None:
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("cannot read tokenizer cache %s (%s); rebuilding", file, exc)
        return None
    try:
        return Tokenizer.from_cache_json(text)
    except Exception as exc:  # any corruption: bad JSON, missing keys, a tokenizer Rust refuses
        logger.warning("corrupt tokenizer cache %s (%s); rebuilding", file, exc)
        return None


def _write_cache_file(file: Path, tokenizer: Tokenizer) -> None:
    """Write through a temporary file and ``os.replace`` so a reader never sees half a file.
    A cache that cannot be written only costs a rebuild next time, so errors are logged."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=file.parent, suffix=".tmp", delete=False
        ) as tmp:
            tmp.write(tokenizer.to_cache_json())
        os.replace(tmp.name, file)
    except OSError as exc:
        logger.warning("cannot write tokenizer cache %s: %s", file, exc)
