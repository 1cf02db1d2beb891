"""Structured output: grammars that constrain sampling, compiled once and matched per request.

A request may carry a :class:`StructuredOutput` (a JSON schema, a regex, a choice of literal
strings, or a Lark context-free grammar). The engine compiles it with llguidance when the
request is made, on the caller's thread, so a request waits for its grammar and never stalls a
step; compiled grammars are cached by source. While a request runs, its :class:`GrammarMatcher`
gives a token bitmask for the next position (computed beside the forward) and consumes every
sampled token. llguidance was chosen over xgrammar because it installs from one dependency-free
wheel here (xgrammar pulls transformers and triton at run time) and computes a mask in ~1 ms.

llguidance is imported only when a grammar is compiled, so ``import agentx`` does not load it,
and its ``llguidance.torch`` helpers are not used at all: that module imports ``torch._dynamo``
(seconds) and ``torch.compile``s its mask kernel on the first constrained step (seconds more, and
a C compiler on CPU). The three tensor helpers it offers are a few lines of plain torch here.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

from agentx.errors import InvalidRequestError

if TYPE_CHECKING:
    import llguidance

__all__ = ["COMPACT_JSON", "GrammarBackend", "GrammarMatcher", "StructuredOutput", "compact_json"]


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Exactly one of: a JSON schema (dict or JSON text), a regex, literal choices, a Lark
    grammar (llguidance's dialect: ``%json {...}`` embeds a JSON schema)."""

    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [f for f in ("json_schema", "regex", "choice", "grammar") if getattr(self, f)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"StructuredOutput takes exactly one of json_schema, regex, choice, grammar; "
                f"got {given or 'none'}"
            )
        if self.choice is not None:
            choice = tuple(self.choice)
            if not all(isinstance(c, str) and c for c in choice):
                raise InvalidRequestError("choice must be non-empty strings")
            object.__setattr__(self, "choice", choice)

    def key(self) -> str:
        """A stable text key for the compile cache."""
        if self.json_schema is not None:
            schema = self.json_schema
            return "json:" + (
                schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
            )
        if self.regex is not None:
            return "regex:" + self.regex
        if self.choice is not None:
            return "choice:" + json.dumps(self.choice)
        return "lark:" + self.grammar

    def to_llguidance(self) -> str:
        import llguidance

        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, str):
                schema = json.loads(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(compact_json(schema)))
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            alternatives = " | ".join(json.dumps(c) for c in self.choice)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return llguidance.LLMatcher.grammar_from_lark(self.grammar)


# One space after "," and ":" and no other whitespace: sampled at temperature 1, a small model
# otherwise fills flexible JSON whitespace with newlines until max_tokens runs out.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def compact_json(schema: Any) -> Any:
    """``schema`` with llguidance's compact-whitespace option, unless it sets its own."""
    if isinstance(schema, dict) and "x-guidance" not in schema:
        return {**schema, "x-guidance": COMPACT_JSON}
    return schema


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the next position into ``bitmask[row]`` (a CPU
        int32 tensor from :meth:`GrammarBackend.allocate_bitmask`)."""
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.itemsize)

    def accept(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more: the request is done."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GrammarBackend:
    """The tokenizer's llguidance view plus a cache of compiled grammars (thread-safe)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        eos = min(eos_token_ids) if eos_token_ids else None
        self._tokenizer = _ll_tokenizer(tokenizer_json, vocab_size, eos)
        self._compiled: dict[str, str] = {}
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> str:
        import llguidance

        key = spec.key()
        with self._lock:
            grammar = self._compiled.get(key)
        if grammar is not None:
            return grammar
        try:
            grammar = spec.to_llguidance()
        except Exception as exc:  # llguidance raises ValueError / RuntimeError on bad input
            raise InvalidRequestError(f"invalid structured output: {exc}") from exc
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._tokenizer
        )
        if is_error:
            raise InvalidRequestError(f"invalid structured output: {'; '.join(messages)}")
        with self._lock:
            self._compiled[key] = grammar
        return grammar

    def new_matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one request; raises InvalidRequestError for a bad grammar."""
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer, self.compile(spec))
        if matcher.is_error():
            raise InvalidRequestError(f"invalid structured output: {matcher.get_error()}")
        return GrammarMatcher(matcher)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """(num_rows, ceil(V / 32)) int32 on the CPU, every token allowed until filled."""
        return torch.full((num_rows, -(-self.vocab_size // 32)), -1, dtype=torch.int32)


@lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer_json: str, vocab_size: int, eos: int | None) -> llguidance.LLTokenizer:
    """Built once per tokenizer in a process (~0.5 s for 49K tokens; engines on one model share
    it); an LLTokenizer is immutable, and matchers only read it."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed tokens' logits to -inf in place; logits (N, V), bitmask (N, W) int32.

    Token ``t`` is allowed when bit ``t % 32`` of word ``t // 32`` is set (llguidance's layout);
    tokens past ``32 * W`` are disallowed. The bitmask may live on another device than logits.
    """
    num_rows, vocab_size = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device, non_blocking=True)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # (N, W, 32)
    allowed = bits.view(num_rows, -1)[:, :vocab_size].bool()  # (N, min(V, 32 W))
    logits[:, : allowed.shape[1]].masked_fill_(~allowed, float("-inf"))
    logits[:, allowed.shape[1] :] = float("-inf")
