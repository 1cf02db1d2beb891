"""Drafting from context: propose the tokens that followed the latest n-gram elsewhere.

Agents copy: tool-call arguments quote paths from earlier tool results, edits re-emit most of a
file, subagents restate their task. A decoding request looks up its last few tokens in n-gram
indexes over what it can see, longest n-gram first, and drafts the tokens that followed the
latest earlier occurrence (suffix matching, no draft model). The step verifies the drafts
beside everything else (runner/model_runner.py); nothing here knows about blocks or batches.

    TokenIndex    n-gram -> position after its latest occurrence, over one append-only list
    DraftSource   a bounded set of finished token lists that many requests can draft from:
                  a session tree's outputs (the session layer makes one and passes it in
                  ``RequestOptions.draft_source``), recent outputs engine-wide (the core's)
    Drafter       one request's drafting: its own index, its sources, its adaptive k, its stats

Lookups cost a few dict probes per request and step, and nothing is drafted when nothing
matches. Everything here runs on the engine loop thread (a session only constructs its source).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

NGRAM_SIZES = (8, 4, 2)  # tried longest first: a longer match predicts its continuation better
_MULT = 1_000_003  # rolling key: key = key * _MULT + token, wrapping like int64
_MASK = (1 << 64) - 1
_BULK = 64  # index this many new tokens or more with one vectorized pass
_MAX_COOLDOWN = 32  # steps a request waits before drafting again after drafts kept failing


def _key(tokens: Sequence[int]) -> int:
    """The int64 key of an n-gram, as torch's wrapping arithmetic computes it in bulk."""
    key = 0
    for t in tokens:
        key = (key * _MULT + t) & _MASK
    return key - (1 << 64) if key >> 63 else key


class TokenIndex:
    """n-gram -> the position right after its latest occurrence in ``token_ids``.

    ``token_ids`` is referenced, not copied: it may only grow. An n-gram ending at the last
    token is indexed once a token follows it, so every hit has a continuation.
    """

    __slots__ = ("maps", "num_indexed", "token_ids")

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.maps: tuple[dict[int, int], ...] = tuple({} for _ in NGRAM_SIZES)
        self.num_indexed = 0  # positions whose next token is indexed: continuations start there

    def update(self) -> None:
        """Index the n-grams ending before the last token that are not indexed yet."""
        end = len(self.token_ids) - 1  # n-grams end at positions < end; they continue at +1
        start = self.num_indexed
        if end <= start:
            return
        if end - start >= _BULK:
            self._update_bulk(start, end)
        else:
            tokens = self.token_ids
            for n, index in zip(NGRAM_SIZES, self.maps, strict=True):
                for i in range(max(start, n - 1), end):
                    index[_key(tokens[i - n + 1 : i + 1])] = i + 1
        self.num_indexed = end

    def _update_bulk(self, start: int, end: int) -> None:
        for n, index in zip(NGRAM_SIZES, self.maps, strict=True):
            first = max(start, n - 1)  # the first n-gram end position to index
            if first >= end:
                continue
            window = torch.tensor(self.token_ids[first - n + 1 : end], dtype=torch.long)
            num = end - first
            keys = torch.zeros(num, dtype=torch.long)
            for j in range(n):
                keys = keys * _MULT + window[j : j + num]
            index.update(zip(keys.tolist(), range(first + 1, end + 1), strict=True))

    def find(self, tail_keys: Sequence[int | None], tail: Sequence[int]) -> int | None:
        """The continuation position of the longest indexed n-gram ending ``tail`` (the keys
        of its last n tokens per size, None where ``tail`` is shorter), or None."""
        tokens = self.token_ids
        for n, key, index in zip(NGRAM_SIZES, tail_keys, self.maps, strict=True):
            if key is None:
                continue
            pos = index.get(key)
            # a key collision only costs a rejected draft, but a check is cheaper than that
            if pos is not None and tokens[pos - n : pos] == list(tail[-n:]):
                return pos
        return None


class DraftSource:
    """Finished token lists (outputs) that requests draft from, newest first, at most
    ``max_entries`` of them. Owned by whoever made it (a session tree, the engine core);
    the engine adds the outputs of requests that name it."""

    def __init__(self, max_entries: int = 16) -> None:
        self.max_entries = max_entries
        self._indexes: deque[TokenIndex] = deque(maxlen=max_entries)

    def add(self, token_ids: Sequence[int]) -> None:
        if self.max_entries <= 0 or len(token_ids) < 2:
            return
        index = TokenIndex(list(token_ids))
        index.update()
        self._indexes.appendleft(index)

    def __len__(self) -> int:
        return len(self._indexes)

    def find(
        self, tail_keys: Sequence[int | None], tail: Sequence[int]
    ) -> tuple[list[int], int] | None:
        """The continuation (to the end of its list) of the longest match, newest list first,
        and the match's n-gram size."""
        best, best_n = None, 0
        for index in self._indexes:
            pos = index.find(tail_keys, tail)
            if pos is None:
                continue
            n = _match_size(index.token_ids, pos, tail)
            if n > best_n:
                best, best_n = index.token_ids[pos:], n
                if n == NGRAM_SIZES[0]:
                    break
        return None if best is None else (best, best_n)


def _match_size(tokens: list[int], pos: int, tail: Sequence[int]) -> int:
    """The largest n-gram size whose n tokens before ``pos`` end ``tail``."""
    for n in NGRAM_SIZES:
        if n <= len(tail) and tokens[pos - n : pos] == list(tail[-n:]):
            return n
    return 0


class Drafter:
    """One request's drafting state.

    ``k`` starts at ``start_k`` (``max_k`` when not given) and adapts to what verification
    accepts: every draft accepted doubles it (up to ``max_k``), a partial acceptance sets it to
    one past the accepted count, and drafts that keep failing whole make the request wait (1,
    2, 4, ... steps, up to 32) before it drafts again, so a request whose context does not
    repeat costs almost nothing.
    """

    __slots__ = (
        "_own",
        "_waits",
        "_misses",
        "k",
        "max_k",
        "num_accepted_tokens",
        "num_draft_tokens",
        "sources",
    )

    def __init__(
        self, max_k: int, sources: Sequence[DraftSource] = (), start_k: int | None = None
    ) -> None:
        self.max_k = max_k
        self.k = max_k if start_k is None else max(1, min(start_k, max_k))
        self.sources = tuple(sources)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self._own: TokenIndex | None = None
        self._misses = 0
        self._waits = 0

    def propose(self, token_ids: list[int], max_num: int) -> list[int]:
        """Up to ``min(k, max_num)`` tokens to follow ``token_ids`` (the request's tokens, an
        append-only list); [] when nothing matches or the request is cooling down."""
        num = min(self.k, max_num)
        if num <= 0:
            return []
        if self._waits:
            self._waits -= 1
            return []
        if self._own is None:
            self._own = TokenIndex(token_ids)
        self._own.update()
        tail = token_ids[-NGRAM_SIZES[0] :]
        keys = [_key(tail[-n:]) if n <= len(tail) else None for n in NGRAM_SIZES]
        pos = self._own.find(keys, tail)
        own_size = 0 if pos is None else _match_size(token_ids, pos, tail)
        if own_size < NGRAM_SIZES[0]:
            for source in self.sources:
                found = source.find(keys, tail)
                if found is not None and found[1] > own_size:
                    return found[0][:num]
        if pos is None:
            return []
        return token_ids[pos : pos + num]

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Verification kept ``num_accepted`` of ``num_drafted`` drafts."""
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if num_accepted == num_drafted:
            self.k = min(self.max_k, 2 * max(self.k, num_drafted))
            self._misses = 0
        elif num_accepted:
            self.k = num_accepted + 1
            self._misses = 0
        else:
            self.k = 1
            self._misses += 1
            self._waits = min(1 << (self._misses - 1), _MAX_COOLDOWN)
