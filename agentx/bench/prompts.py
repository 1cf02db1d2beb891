"""Prompts from hash ids, in two modes (``agentx bench --prompts text|random``):

- ``text`` (:class:`TextPromptBuilder`, the default): every block id becomes a fixed block of
  real text cut from the committed corpus (:mod:`agentx.bench.corpus`: code, tool output,
  prose), about ``block_size`` tokens long; each engine adapter tokenizes it with its own
  tokenizer, so every engine gets the same text. A greedy continuation of text reads like text.
- ``random`` (:class:`PromptBuilder`): every block id becomes a fixed block of random token ids.
  Kept for the record and for probes that need exact lengths (``saturate``); a greedy
  continuation of random ids loops, which drafting from context predicts.

Both build one :data:`~agentx.bench.segments.Segment` per request range (``segment``); overlap
is exactly where hash ids overlap, in either mode.

Random mode: ``block_tokens(scope, hash_id)`` is a pure function of its arguments and of the
token space: the same id gives the same ``block_size`` tokens in every process, on every
machine and for every engine (it hashes ``(scope, hash_id, counter)`` with BLAKE2b; no RNG whose
stream could change between library versions). Different ids give unrelated tokens, so prompts
overlap exactly where their hash ids do. A partial last block is a prefix of its block's tokens;
tokens a trace's ids do not cover (``in`` larger than its blocks) are filled from a per-request
private block (text mode likewise, with text).

Token ids are drawn from a :class:`TokenSpace`: a range of ordinary ids of the model's vocabulary,
minus its special tokens (a stray end-of-turn or BOS inside a prompt would change what engines do).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from agentx.bench.corpus import Corpus
from agentx.bench.segments import Segment

SMOLLM2_VOCAB_SIZE = 49_152
SMOLLM2_NUM_SPECIAL = 17  # ids 0..16 are <|endoftext|>, <|im_start|>, <|im_end|>, ...


@dataclass(frozen=True, slots=True)
class TokenSpace:
    """The ids prompts may use: ``[low, high)`` without ``excluded``."""

    low: int
    high: int
    excluded: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"empty token space [{self.low}, {self.high})")

    @classmethod
    def for_vocab(cls, vocab_size: int, special_ids: Iterable[int] = ()) -> TokenSpace:
        """Every id of the vocabulary except the special ones (kept out of ``[low, high)`` when
        they sit at either end of the vocabulary, as they usually do)."""
        special = set(special_ids)
        low, high = 0, vocab_size
        while low in special:
            low += 1
        while high - 1 in special:
            high -= 1
        return cls(low, high, frozenset(i for i in special if low <= i < high))

    @classmethod
    def default(cls) -> TokenSpace:
        """SmolLM2-135M's vocabulary without its special tokens."""
        return cls(SMOLLM2_NUM_SPECIAL, SMOLLM2_VOCAB_SIZE)

    @property
    def num_ids(self) -> int:
        return self.high - self.low  # excluded ids are skipped by remapping, see token()

    def token(self, value: int) -> int:
        token_id = self.low + value % self.num_ids
        while token_id in self.excluded:  # rare: move to the next allowed id
            token_id = self.low + (token_id - self.low + 1) % self.num_ids
        return token_id


class PromptSource(ABC):
    """Prompt content for a trace's hash ids; ``block_size`` tokens per id."""

    block_size: int
    mode: str

    @abstractmethod
    def segment(
        self, scope: str, hash_ids: tuple[int, ...], num_tokens: int, filler_key: str = ""
    ) -> Segment:
        """About ``num_tokens`` tokens (exactly, for ids): block after block, the last one cut to
        a prefix of its block; past the last id, a private filler keyed by ``filler_key``
        (unique per request). A pure function of its arguments."""


class PromptBuilder(PromptSource):
    """Token ids of trace prompts; blocks are cached, so shared prefixes cost nothing twice."""

    mode = "random"

    def __init__(self, block_size: int, space: TokenSpace | None = None) -> None:
        self.block_size = block_size
        self.space = space or TokenSpace.default()
        self.block_tokens = lru_cache(maxsize=1 << 16)(self._block_tokens)

    def _block_tokens(self, scope: str, hash_id: int) -> tuple[int, ...]:
        out: list[int] = []
        counter = 0
        while len(out) < self.block_size:
            key = f"{scope}\x00{hash_id}\x00{counter}".encode()
            digest = hashlib.blake2b(key, digest_size=64).digest()
            out.extend(
                self.space.token(int.from_bytes(digest[i : i + 4], "little"))
                for i in range(0, 64, 4)
            )
            counter += 1
        return tuple(out[: self.block_size])

    def prompt(
        self, scope: str, hash_ids: tuple[int, ...], num_tokens: int, filler_key: str = ""
    ) -> list[int]:
        """``num_tokens`` ids: block after block, the last one cut; past the last id, tokens of
        a private filler block keyed by ``filler_key`` (unique per request)."""
        out: list[int] = []
        for hash_id in hash_ids:
            if len(out) >= num_tokens:
                break
            out.extend(self.block_tokens(scope, hash_id)[: num_tokens - len(out)])
        part = 0
        while len(out) < num_tokens:
            filler = self.block_tokens(f"{scope}\x00filler\x00{filler_key}", part)
            out.extend(filler[: num_tokens - len(out)])
            part += 1
        return out

    def segment(
        self, scope: str, hash_ids: tuple[int, ...], num_tokens: int, filler_key: str = ""
    ) -> Segment:
        return tuple(self.prompt(scope, hash_ids, num_tokens, filler_key))


class TextPromptBuilder(PromptSource):
    """Text of trace prompts: each id's block is corpus text keyed by ``(scope, hash_id)``."""

    mode = "text"

    def __init__(self, block_size: int, corpus: Corpus | None = None) -> None:
        self.block_size = block_size
        self.corpus = corpus or Corpus.load()
        self.block_text = lru_cache(maxsize=1 << 16)(self._block_text)

    def _block_text(self, key: str, num_tokens: int) -> str:
        return self.corpus.text(key.encode(), num_tokens)

    def segment(
        self, scope: str, hash_ids: tuple[int, ...], num_tokens: int, filler_key: str = ""
    ) -> Segment:
        parts: list[str] = []
        done = 0
        for hash_id in hash_ids:
            if done >= num_tokens:
                break
            take = min(self.block_size, num_tokens - done)
            parts.append(self.block_text(f"{scope}\x00{hash_id}", take))
            done += take
        part = 0
        while done < num_tokens:
            take = min(self.block_size, num_tokens - done)
            parts.append(self.block_text(f"{scope}\x00filler\x00{filler_key}\x00{part}", take))
            done += take
            part += 1
        return "".join(parts)


def make_prompt_source(mode: str, block_size: int, space: TokenSpace | None = None):
    """``text`` or ``random`` prompts for a trace of ``block_size``-token blocks."""
    if mode == "text":
        return TextPromptBuilder(block_size)
    if mode == "random":
        return PromptBuilder(block_size, space)
    raise ValueError(f"prompts must be 'text' or 'random', got {mode!r}")
