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

from agentx.engine.grammar_budget import CompletionSearch, CompletionVocab, GrammarBudget
from agentx.errors import InvalidRequestError

if TYPE_CHECKING:
    import llguidance

# Compiled grammars (and their completion searches) kept per backend, least recently used
# dropped first: every distinct schema a caller sends would otherwise stay forever.
MAX_COMPILED_GRAMMARS = 256

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
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequestError(f"{name} must be a str, got {getattr(self, name)!r}")
        if self.json_schema is not None and not isinstance(self.json_schema, dict | str):
            raise InvalidRequestError(
                f"json_schema must be a dict or JSON text, got {self.json_schema!r}"
            )
        if self.choice is not None:
            if isinstance(self.choice, str | bytes) or not hasattr(
                self.choice, "__iter__"
            ):  # tuple("abc") would be three choices
                raise InvalidRequestError(
                    f"choice must be a sequence of strings, got the string {self.choice!r}"
                )
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
            # one lexeme (a terminal): the lexer matches any number of choices, where one
            # parser alternative each overflows llguidance's row (2,000 items) at run time
            alternatives = " | ".join(json.dumps(c) for c in self.choice)
            return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {alternatives}")
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
    """One request's position in its grammar, and its token budget (``grammar_budget.py``)
    when it has one."""

    def __init__(self, matcher: llguidance.LLMatcher, budget: GrammarBudget | None = None) -> None:
        self._matcher = matcher
        self.budget = budget
        self.failed = False  # a committed token was rejected

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the next position into ``bitmask[row]`` (a CPU
        int32 tensor from :meth:`GrammarBackend.allocate_bitmask`); a budget with no slack
        left narrows them to its plan's next token."""
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.itemsize)
        forced = self.budget.forced_token if self.budget is not None else None
        if forced is not None:
            mask = bitmask[row]
            if not _allows_only(mask, forced):
                self.budget.closed = True  # the grammar allowed more: the budget chose
            mask.zero_()
            mask[forced >> 5] = _bit_word(forced & 31)

    def accept(self, token_id: int) -> bool:
        """Consume ``token_id`` as it is (no budget); False once the matcher is in error."""
        return self._matcher.consume_token(token_id)

    # ---- drafts (engine/draft.py): verified under the masks the grammar gives each position --

    @property
    def is_forced(self) -> bool:
        """The budget has no slack: the next mask is its plan's token alone."""
        return self.budget is not None and self.budget.forced_token is not None

    def draftable(self, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` the grammar accepts from here, [] while the
        budget has no slack (the state does not move)."""
        if not drafts or self.is_forced or self.is_error:
            return []
        return drafts[: self._matcher.validate_tokens(drafts)]

    def fill_draft_bitmasks(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Row ``row`` as :meth:`fill_bitmask` writes it, then row ``row + j`` the grammar's
        own mask after ``drafts[:j]``; the state is put back. The budget's say over a drafted
        position (``is_forced`` there) is checked when its token is committed."""
        self.fill_bitmask(bitmask, row)
        consumed = 0
        for j, token_id in enumerate(drafts, 1):
            # a stopped matcher takes nothing more (EOS included) and does not count it for
            # rollback; what follows the grammar's end is never output: its rows keep the
            # stopped state's mask
            if not self._matcher.is_stopped():
                if not self._matcher.consume_token(token_id):
                    break  # cannot happen for draftable() drafts; the rows stay all-zero
                consumed += 1
            words = bitmask[row + j]
            self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.itemsize)
        self._matcher.rollback(consumed)

    def commit(self, token_id: int) -> int:
        """Consume a sampled token, or the token the budget puts in its place (see
        ``GrammarBudget.commit``); returns the token consumed."""
        if self.budget is None:
            if not self._matcher.consume_token(token_id):
                self.failed = True
            return token_id
        token_id = self.budget.commit(self._matcher, token_id)
        if self._matcher.is_error():
            self.failed = True
        return token_id

    @property
    def is_error(self) -> bool:
        """The matcher rejected a token (or failed inside): the output breaks the grammar."""
        return self.failed or self._matcher.is_error()

    @property
    def budget_closed(self) -> bool:
        """The budget decided at least one token: the output is complete but cut short."""
        return self.budget is not None and self.budget.closed

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


def _first_line(matcher: llguidance.LLMatcher) -> str:
    """llguidance's error without the parser state dump that follows it."""
    return (matcher.get_error() or "the grammar stopped").splitlines()[0]


def _bit_word(bit: int) -> int:
    """The int32 word with only ``bit`` set."""
    return (1 << bit) - (1 << 32 if bit == 31 else 0)


def _allows_only(mask: torch.Tensor, token_id: int) -> bool:
    """The packed (V/32,) int32 ``mask`` allows ``token_id`` and nothing else."""
    nonzero = mask.nonzero()
    word = token_id >> 5
    return (
        len(nonzero) == 1
        and int(nonzero[0]) == word
        and int(mask[word]) == _bit_word(token_id & 31)
    )


class GrammarBackend:
    """The tokenizer's llguidance view plus a cache of compiled grammars (thread-safe)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        eos = min(eos_token_ids) if eos_token_ids else None
        self._tokenizer = _ll_tokenizer(tokenizer_json, vocab_size, eos)
        self._compiled: dict[str, str] = {}
        self._searches: dict[str, CompletionSearch] = {}
        self._vocab: CompletionVocab | None = None
        self._eos = eos if eos is not None else 0
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> str:
        import llguidance

        key = spec.key()
        with self._lock:
            grammar = self._compiled.pop(key, None)
            if grammar is not None:
                self._compiled[key] = grammar  # most recently used last
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
            while len(self._compiled) > MAX_COMPILED_GRAMMARS:  # oldest first (dicts keep order)
                old = next(iter(self._compiled))
                del self._compiled[old]
                self._searches.pop(old, None)
        return grammar

    def new_matcher(self, spec: StructuredOutput, max_tokens: int | None = None) -> GrammarMatcher:
        """A fresh matcher for one request; with ``max_tokens`` (what the output may hold) it
        ends complete within them. Raises InvalidRequestError for a bad grammar, or for
        ``max_tokens`` below the shortest output the grammar allows."""
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer, self.compile(spec))
        matcher.compute_bitmask()  # a start that leads nowhere ({"$ref": "#"}) fails here
        if matcher.is_error():
            raise InvalidRequestError(
                f"invalid structured output: no output satisfies it ({_first_line(matcher)})"
            )
        if max_tokens is None:
            return GrammarMatcher(matcher)
        search = self._search_for(spec.key())
        plan = search.shortest(matcher)
        if plan is None and search.failure is not None:
            reason = search.failure.splitlines()[0]
            raise InvalidRequestError(
                "invalid structured output: it fails when run, before any output completes "
                f"it (no finite output, or over llguidance's limits: {reason})"
            )
        if plan is None:  # no completion found within the search's limits: no guarantee
            return GrammarMatcher(matcher)
        if len(plan) > max_tokens:
            raise InvalidRequestError(
                f"the output may hold {max_tokens} tokens, but the shortest output this grammar "
                f"allows takes {len(plan)}: raise max_tokens to at least {len(plan)}"
            )
        return GrammarMatcher(matcher, GrammarBudget(search, plan, max_tokens))

    def min_tokens(self, spec: StructuredOutput) -> int | None:
        """Tokens in the shortest output of ``spec`` the search finds (None: none found)."""
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer, self.compile(spec))
        plan = self._search_for(spec.key()).shortest(matcher)
        return None if plan is None else len(plan)

    def _search_for(self, key: str) -> CompletionSearch:
        with self._lock:
            if self._vocab is None:
                tok = self._tokenizer
                token_bytes = [tok.decode_bytes([i]) for i in range(self.vocab_size)]
                special = {i for i in range(self.vocab_size) if tok.is_special_token(i)}
                self._vocab = CompletionVocab(token_bytes, special, self._eos)
            search = self._searches.get(key)
            if search is None:
                search = self._searches[key] = CompletionSearch(self._vocab)
                if len(self._searches) > MAX_COMPILED_GRAMMARS:
                    del self._searches[next(iter(self._searches))]
            return search

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
