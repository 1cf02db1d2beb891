"""Text <-> token ids for one checkpoint: the vocabulary, its special ids and its chat template.

Owns :class:`Tokenizer` (a thin wrapper over a ``tokenizers.Tokenizer``) and how one is read from
a Hugging Face folder. Building from GGUF metadata (and caching it) lives in ``tokenizer_gguf``,
template rendering in ``chat_template``, streaming text in ``detokenizer``. It knows nothing
about weights, models or sessions.

Its libraries (``tokenizers``, ``jinja2`` for templates, ``gguf`` for metadata) are imported where
they are used, so ``import agentx`` does not pay for them; an engine loads them when it starts.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentx.errors import InvalidRequestError, ModelLoadError

if TYPE_CHECKING:
    import tokenizers

    from agentx.engine.models.loader.gguf_file import GGUFFile

__all__ = ["Tokenizer"]

logger = logging.getLogger(__name__)

# Turn-end tokens of common chat formats. One is an extra stop id only when the vocabulary has it
# and the chat template writes it: then the model was trained to end its turns with it, even when
# the checkpoint's single eos id names another token (SmolLM2 GGUF: eos is <|im_end|> itself;
# Llama 3: eos is <|end_of_text|> but turns end with <|eot_id|>).
_CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

# Bump when the cached JSON layout or the way a tokenizer is built changes.
_CACHE_FORMAT = 1

_RELEASE_GIL_CHARS = 16 << 10


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
        # the model family's tool-call format by name (agentx/session/tool_formats.py), set
        # from EngineConfig.tool_call_format; None: detected from the chat template
        self.tool_call_format: str | None = None
        self._extra_eos_token_ids = tuple(sorted(set(extra_eos_token_ids)))
        self._max_piece_chars = 0  # the longest vocabulary piece, found on first use
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
        """Token ids of ``text``; InvalidRequestError for what is not a str of valid Unicode
        (a lone surrogate cannot be encoded to UTF-8, so no tokenizer can read it)."""
        try:
            if isinstance(text, str) and len(text) > _RELEASE_GIL_CHARS:
                # encode_batch runs without the GIL (encode holds it throughout): a long text
                # tokenized in a worker thread leaves the caller's event loop running
                ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
            else:
                ids = self._backend.encode(text, add_special_tokens=False).ids
        except TypeError:
            raise InvalidRequestError(_why_not_text(text)) from None
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def min_num_tokens(self, num_chars: int) -> int:
        """A lower bound of the tokens any text of ``num_chars`` characters encodes to, known
        without encoding it: no token stands for more characters than its vocabulary piece has
        (byte-level pieces spell one character per byte); the factor 2 leaves room for
        normalizers that compose characters. What refuses a huge text at once."""
        # getattr: a tokenizer unpickled from a loader cache an older agentx wrote lacks it
        if getattr(self, "_max_piece_chars", 0) == 0:
            vocab = self._backend.get_vocab(with_added_tokens=True)
            self._max_piece_chars = max((len(piece) for piece in vocab), default=1)
        return num_chars // (2 * self._max_piece_chars)

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
        import jinja2

        if self.chat_template is None:
            raise InvalidRequestError(
                "this checkpoint has no chat template; send a plain prompt or token ids instead"
            )
        template = self.get_compiled_chat_template()
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

    def get_compiled_chat_template(self) -> Any:
        """The chat template as a compiled ``jinja2.Template`` (None without a template).

        Compiled once per template text (cached); an engine calls this at start so the first
        turn does not pay for it. Raises InvalidRequestError when the template does not parse.
        """
        from agentx.engine.models.chat_template import compile_chat_template

        return None if self.chat_template is None else compile_chat_template(self.chat_template)

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
    def from_gguf(cls, source: GGUFFile | str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer a GGUF file describes, built once per file version and cached.

        Looks in the in-process cache, then in ``<cache_dir>/tokenizers/<key>.json``, and builds
        from the metadata only when both miss (the key is the file's path, mtime and size). A
        given reader is used for that build; a path is opened only if it comes to that.
        """
        from agentx.engine.models.loader.gguf_file import GGUFFile
        from agentx.engine.models.tokenizer_gguf import cached_gguf_tokenizer, open_gguf

        if isinstance(source, GGUFFile):
            path = source.path
            return cached_gguf_tokenizer(path, lambda: source)
        path = Path(source)
        return cached_gguf_tokenizer(path, lambda: open_gguf(path))

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Read ``tokenizer.json``, ``tokenizer_config.json``, the chat template and the eos ids
        of ``generation_config.json`` / ``config.json`` from a Hugging Face model folder."""
        import tokenizers

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
        import tokenizers

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


def _why_not_text(text: object) -> str:
    if not isinstance(text, str):
        return f"text to encode must be a str, got {type(text).__name__}"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"text is not valid Unicode (a lone surrogate at {exc.start}): {exc.reason}"
    return "the tokenizer cannot encode this text"
