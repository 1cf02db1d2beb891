"""A prompt as segments: text, which each engine adapter tokenizes with its own tokenizer, or
token ids (a turn's generated output, or a random-id prompt), concatenated in order.

Segments are tokenized one by one and their ids concatenated, never the joined text, so a prompt
that extends another by whole segments has token ids that extend the other's exactly (the
closed loop relies on it: :mod:`agentx.bench.closed_loop`). A leaf module: it knows no engine,
trace or corpus.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

Segment = str | tuple[int, ...]
Encode = Callable[[str], list[int]]  # text -> token ids, no special tokens added


@dataclass(frozen=True, slots=True)
class Prompt:
    segments: tuple[Segment, ...]

    def token_ids(self, encode: Encode | None) -> list[int]:
        """The prompt's ids; ``encode`` tokenizes text segments (None: there must be none)."""
        out: list[int] = []
        for segment in self.segments:
            if isinstance(segment, str):
                if encode is None:
                    raise ValueError("a text prompt needs a tokenizer")
                out.extend(encode(segment))
            else:
                out.extend(segment)
        return out

    @property
    def has_text(self) -> bool:
        return any(isinstance(s, str) for s in self.segments)


def prompt_token_ids(prompt: list[int] | Prompt, encode: Encode | None) -> list[int]:
    """Token ids of either prompt form (a plain id list is returned as is)."""
    return prompt.token_ids(encode) if isinstance(prompt, Prompt) else prompt


def cached_encode(encode: Encode, maxsize: int = 2048) -> Encode:
    """``encode`` with an LRU cache: a closed-loop session sends its earlier text segments again
    with every turn (``maxsize`` covers the live sessions' segments; an evicted one is only
    tokenized again)."""
    cached = lru_cache(maxsize=maxsize)(lambda text: tuple(encode(text)))
    return lambda text: list(cached(text))
