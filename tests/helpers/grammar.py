"""Random walks through a grammar: outputs sampled uniformly over the tokens its mask allows,
half the time only among short tokens (which open strings, lists and objects far more often
than a model does). Shared by the grammar tests."""

from __future__ import annotations

import random

import numpy as np

from agentx.engine.structured import GrammarBackend, GrammarMatcher

__all__ = [
    "Walk",
    "sample_any",
    "sample_short",
    "short_token_ids",
]


def short_token_ids(tokenizer) -> np.ndarray:
    """Ids of the tokens of one or two characters: the ones that open and close structure."""
    size = tokenizer.vocab_size
    return np.array([i for i in range(size) if len(tokenizer.token_to_text(i)) <= 2])


class Walk:
    """One output sampled at random under the budget: what was sampled, what was kept."""

    def __init__(
        self, backend: GrammarBackend, matcher: GrammarMatcher, short: np.ndarray, seed: int
    ) -> None:
        self.sampled: list[int] = []
        self.token_ids: list[int] = []
        rng = random.Random(seed)
        bitmask = backend.allocate_bitmask(1)
        while matcher.budget.num_left > 0 and not matcher.is_terminated:
            matcher.fill_bitmask(bitmask, 0)
            words = bitmask[0].numpy().view(np.uint32)
            token_id = sample_short(rng, words, short) if rng.random() < 0.5 else None
            if token_id is None:
                token_id = sample_any(rng, words, backend.vocab_size)
            self.sampled.append(token_id)
            self.token_ids.append(matcher.commit(token_id))


def sample_short(rng: random.Random, words: np.ndarray, short: np.ndarray) -> int | None:
    """Uniform among the ``short`` token ids the packed mask ``words`` allows, None if none."""
    bits = (words[short >> 5] >> (short & 31).astype(np.uint32)) & 1
    return _choose(rng, short[bits.astype(bool)])


def sample_any(rng: random.Random, words: np.ndarray, vocab_size: int) -> int:
    """Uniform among the tokens the packed mask ``words`` allows."""
    for _ in range(8):  # mostly enough: in a string most tokens are allowed
        token_id = rng.randrange(vocab_size)
        if (int(words[token_id >> 5]) >> (token_id & 31)) & 1:
            return token_id
    allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
    return _choose(rng, np.flatnonzero(allowed))


def _choose(rng: random.Random, token_ids: np.ndarray) -> int | None:
    return int(token_ids[rng.randrange(len(token_ids))]) if len(token_ids) else None
