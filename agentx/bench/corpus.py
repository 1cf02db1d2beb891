"""The text corpus that text-backed prompts are cut from, and how a block of it is chosen.

``data/agent_corpus.txt`` holds the kinds of text an agent's prompts carry: source code, tool
output (``ls`` listings, pytest logs, diffs, tracebacks, grep hits) and prose (docstrings,
instructions), all from CPython's standard library (PSF License, ``data/LICENSE-PSF.txt``) or
generated from it with a seeded RNG by ``benchmarks/make_corpus.py``. The file is committed and
held by :data:`CORPUS_SHA256` (a test), so every machine cuts the same text whatever its Python.

``Corpus.text(key, num_tokens)`` is a pure function of its arguments: BLAKE2b of ``key`` picks a
kind (by :data:`KIND_WEIGHTS`) and a word of that kind's text to start at (any word, not only
line starts: fewer distinct ids share a block's text), and the block runs
``num_tokens`` times the kind's characters per token (SmolLM2's tokenizer, measured: a block
of 64 tokens tokenizes to about 64 with it; other tokenizers see the same text, a little longer
or shorter). A shorter request for the same key is a prefix of the longer one. This module knows
nothing about tokenizers, traces or engines.
"""

from __future__ import annotations

import bisect
import hashlib
import re
from functools import cache
from pathlib import Path

CORPUS_PATH = Path(__file__).parent / "data" / "agent_corpus.txt"
CORPUS_SHA256 = "e9716e01d9984e0885e9af85ba9f3e7d32862b397a3799c2f10c9e8b923eddda"
SEPARATOR = "\x1e"  # each document: SEPARATOR, its kind, a newline, its text
KIND_WEIGHTS = {"code": 0.4, "tool": 0.4, "prose": 0.2}
# characters per SmolLM2 token of each kind, measured on prompts of many joined blocks (a cut
# word at a block's end costs a token or so): a 4K-token prompt tokenizes to 4K +- 8%
CHARS_PER_TOKEN = {"code": 3.66, "tool": 2.54, "prose": 3.66}


class Corpus:
    """The corpus split by kind; each kind's documents joined into one text, read circularly."""

    def __init__(self, text: str) -> None:
        parts: dict[str, list[str]] = {kind: [] for kind in KIND_WEIGHTS}
        for doc in text.split(SEPARATOR)[1:]:
            kind, _, body = doc.partition("\n")
            parts[kind].append(body)
        self.texts = {kind: "".join(docs) for kind, docs in parts.items()}
        self.word_starts = {kind: _word_starts(t) for kind, t in self.texts.items()}
        self._kinds = tuple(KIND_WEIGHTS)
        total, self._cumulative = 0.0, []
        for kind in self._kinds:
            total += KIND_WEIGHTS[kind]
            self._cumulative.append(total)

    @classmethod
    @cache
    def load(cls) -> Corpus:
        """The committed corpus (read once per process)."""
        return cls(CORPUS_PATH.read_text(encoding="utf-8"))

    def kind_of(self, key: bytes) -> str:
        u = int.from_bytes(_digest(key)[:8], "little") / 2**64 * self._cumulative[-1]
        return self._kinds[min(bisect.bisect_right(self._cumulative, u), len(self._kinds) - 1)]

    def text(self, key: bytes, num_tokens: int) -> str:
        """About ``num_tokens`` tokens of one kind of text, starting at a word chosen by ``key``."""
        kind = self.kind_of(key)
        source, starts = self.texts[kind], self.word_starts[kind]
        start = starts[int.from_bytes(_digest(key)[8:16], "little") % len(starts)]
        num_chars = max(1, round(num_tokens * CHARS_PER_TOKEN[kind]))
        out = source[start : start + num_chars]
        while len(out) < num_chars:  # past the end: wrap around
            out += source[: num_chars - len(out)]
        return out


def corpus_sha256(text: str | None = None) -> str:
    text = CORPUS_PATH.read_text(encoding="utf-8") if text is None else text
    return hashlib.sha256(text.encode()).hexdigest()


def _digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=16, person=b"agentx-corpus").digest()


def _word_starts(text: str) -> list[int]:
    """Offsets of the characters that end a run of whitespace (and 0)."""
    return [0] + [m.start() for m in re.finditer(r"(?<=\s)\S", text)]
