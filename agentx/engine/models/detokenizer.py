"""Streaming detokenization: token ids in, text deltas out, never half a character."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentx.engine.models.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]


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
