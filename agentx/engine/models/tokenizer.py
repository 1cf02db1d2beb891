"""Text <-> token ids for one checkpoint: the vocabulary, its special ids and its chat template.

Owns :class:`Tokenizer` (a thin wrapper over a ``tokenizers.Tokenizer``), how one is built from a
GGUF file's ``tokenizer.ggml.*`` metadata or from a Hugging Face folder, the cache of GGUF-built
tokenizers (in process and on disk), chat-template rendering, and :class:`IncrementalDetokenizer`
for streaming. It knows nothing about weights, models or sessions.

A GGUF file carries no ``tokenizer.json``: only tokens, merges and token types. The byte-level BPE
is rebuilt from them, with the pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre`` (the split
the merges were learned on); the original ``tokenizer.json`` cannot be recovered byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
import tokenizers
from gguf import GGUFReader
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from agentx import env
from agentx.errors import InvalidRequestError, ModelLoadError

__all__ = ["IncrementalDetokenizer", "Tokenizer", "clear_tokenizer_cache"]

logger = logging.getLogger(__name__)

# Turn-end tokens of common chat formats. One is an extra stop id only when the vocabulary has it
# and the chat template writes it: then the model was trained to end its turns with it, even when
# the checkpoint's single eos id names another token (SmolLM2 GGUF: eos is <|im_end|> itself;
# Llama 3: eos is <|end_of_text|> but turns end with <|eot_id|>).
_CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Bump when the cached JSON layout or the way a tokenizer is built changes.
_CACHE_FORMAT = 1


class Tokenizer:
    """Encode, decode and render chat templates for one checkpoint. Immutable once built.

    ``encode`` never lets the backend add special tokens; a BOS is prepended here, and only when
    ``add_special_tokens`` is asked for and the checkpoint says it wants one (``add_bos``). Special
    tokens written in the text (``<|im_start|>``) always encode to their single id.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id  # the checkpoint's own eos; the template's ``eos_token``
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._extra_eos_token_ids = tuple(sorted(set(extra_eos_token_ids)))
        eos = {eos_token_id} if eos_token_id is not None else set()
        self.eos_token_ids = frozenset(
            eos | set(self._extra_eos_token_ids) | _chat_end_ids(backend, chat_template)
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``; treat it as read-only."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._backend.id_to_token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_text(self, token_id: int) -> str:
        """The text one token decodes to on its own (a lone piece of a multi-byte character
        decodes to ``\\ufffd``)."""
        return self._backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render ``messages`` with the checkpoint's template, as Hugging Face does.

        Raises InvalidRequestError when there is no template, or when it rejects the messages
        (``raise_exception`` in the template, a missing key, a wrong type).
        """
        if self.chat_template is None:
            raise InvalidRequestError(
                "this checkpoint has no chat template; send a plain prompt or token ids instead"
            )
        template = _compile_chat_template(self.chat_template)
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **extra}
        try:
            return template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except (jinja2.TemplateError, TypeError) as exc:
            raise InvalidRequestError(f"the chat template failed on these messages: {exc}") from exc

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> list[int]:
        """The rendered template's ids; the template writes any BOS itself, so none is added."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra
        )
        return self.encode(text, add_special_tokens=False)

    @classmethod
    def from_gguf(cls, source: GGUFReader | str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer a GGUF file describes, built once per file version and cached.

        Looks in the in-process cache, then in ``<cache_dir>/tokenizers/<key>.json``, and builds
        from the metadata only when both miss (the key is the file's path, mtime and size). A
        given reader is used for that build; a path is opened only if it comes to that.
        """
        if isinstance(source, GGUFReader):
            path = Path(source.data.filename)
            return _cached_gguf_tokenizer(path, lambda: source)
        path = Path(source)
        return _cached_gguf_tokenizer(path, lambda: _open_gguf(path))

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Read ``tokenizer.json``, ``tokenizer_config.json``, the chat template and the eos ids
        of ``generation_config.json`` / ``config.json`` from a Hugging Face model folder."""
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"{folder}: no tokenizer.json (only fast tokenizers are read)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises plain Exception on a bad file
            raise ModelLoadError(f"{file}: not a readable tokenizer.json: {exc}") from exc
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(folder / "tokenizer_config.json")
        bos = _special_id(backend, config.get("bos_token"))
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):  # not stated: does the post-processor add it?
            add_bos = bos is not None and bos in backend.encode("", add_special_tokens=True).ids
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=_special_id(backend, config.get("eos_token")),
            extra_eos_token_ids=_hf_eos_ids(folder),
            add_bos=add_bos,
            chat_template=_hf_chat_template(folder, config),
        )

    def to_cache_json(self) -> str:
        """Everything needed to rebuild this tokenizer, as one JSON document."""
        return json.dumps(
            {
                "format": _CACHE_FORMAT,
                "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id,
                "extra_eos_token_ids": list(self._extra_eos_token_ids),
                "add_bos": self.add_bos,
                "chat_template": self.chat_template,
                "tokenizer": self._backend.to_str(),
            },
            ensure_ascii=False,
        )

    @classmethod
    def from_cache_json(cls, text: str) -> Tokenizer:
        """Inverse of :meth:`to_cache_json`; raises ValueError/KeyError/Exception on bad input."""
        data = json.loads(text)
        if data["format"] != _CACHE_FORMAT:
            raise ValueError(f"cache format {data['format']!r}, expected {_CACHE_FORMAT}")
        return cls(
            tokenizers.Tokenizer.from_str(data["tokenizer"]),
            bos_token_id=data["bos_token_id"],
            eos_token_id=data["eos_token_id"],
            extra_eos_token_ids=data["extra_eos_token_ids"],
            add_bos=data["add_bos"],
            chat_template=data["chat_template"],
        )


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, withholding incomplete characters.

    Two offsets into the ids: ``prefix`` (where the last completed window began) and ``read``
    (where it ended). Each push decodes ``ids[prefix:read]`` and ``ids[prefix:]``; the difference
    is the new text, minus any trailing ``\ufffd`` (a multi-byte character still missing bytes),
    which waits for the next push::

        ids:  ... | completed | new tokens (their text partly emitted) |
                  ^prefix     ^read                                   ^len(ids)

    Decoding a short window instead of everything keeps a push O(window), and starting it one
    window back gives the decoder context at the boundary. ``prompt_ids_tail`` (the last few
    prompt ids) seeds that context without being emitted; without it the concatenation of all
    pushes (plus :meth:`flush`) equals ``tokenizer.decode(all_pushed_ids)``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids_tail: list[int] | None = None,
        skip_special_tokens: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids_tail or ())
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_pending_chars_emitted = 0  # text of ids[read:] already handed out
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    def push(self, token_ids: list[int]) -> str:
        """Add generated ids; return the text they complete (may be empty)."""
        self._ids.extend(token_ids)
        return self._take(final=False)

    def flush(self) -> str:
        """Emit whatever is pending, incomplete characters included (at the end of a stream)."""
        return self._take(final=True)

    def _take(self, *, final: bool) -> str:
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._decode(self._ids[self._prefix_offset :])
        start = len(before) + self._num_pending_chars_emitted
        end = len(after) if final else len(after.rstrip("\ufffd"))
        if end <= start:
            return ""
        if end == len(after):  # everything decoded is whole: the window moves on
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._num_pending_chars_emitted = 0
        else:
            self._num_pending_chars_emitted = end - len(before)
        delta = after[start:end]
        self._chunks.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


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


def _build_from_gguf(reader: GGUFReader) -> Tokenizer:
    model = _gguf_value(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')"
        )
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
    return Tokenizer(
        backend,
        bos_token_id=_gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_gguf_value(reader, "tokenizer.ggml.eos_token_id"),
        add_bos=recipe.add_bos if add_bos is None else bool(add_bos),
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


def _gguf_value(reader: GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
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


def _cached_gguf_tokenizer(path: Path, open_reader: Callable[[], GGUFReader]) -> Tokenizer:
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


# --- Hugging Face folders ---------------------------------------------------------------------


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{file}: not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _special_id(backend: tokenizers.Tokenizer, token: str | dict[str, Any] | None) -> int | None:
    """tokenizer_config.json writes a special token as its text or as ``{"content": text}``."""
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def _hf_eos_ids(folder: Path) -> list[int]:
    """Stop ids the folder declares besides the tokenizer's eos (an int or a list, in either)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        value = _read_json(folder / name).get("eos_token_id")
        values = value if isinstance(value, list) else [value]
        ids.extend(v for v in values if isinstance(v, int))
    return ids


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """From tokenizer_config.json (a string, or a list of named templates: take "default"), else
    from the ``chat_template.jinja`` / ``chat_template.json`` files newer transformers write."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {item.get("name"): item.get("template") for item in template}
        template = named.get("default", next(iter(named.values()), None))
    if isinstance(template, str):
        return template
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None


def _chat_end_ids(backend: tokenizers.Tokenizer, chat_template: str | None) -> set[int]:
    if not chat_template:
        return set()
    ids = (backend.token_to_id(t) for t in _CHAT_END_TOKENS if t in chat_template)
    return {token_id for token_id in ids if token_id is not None}


# --- chat templates ---------------------------------------------------------------------------


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for Hugging Face's training
    masks; some templates use it, and here it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(f"the chat template rejected the messages: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and '; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> jinja2.Template:
    # Same environment settings as Hugging Face, so templates render to the same text.
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(f"the checkpoint's chat template does not parse: {exc}") from exc
