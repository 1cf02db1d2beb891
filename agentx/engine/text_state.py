"""TextState: one request's incremental text, with stop strings applied.

Shared by every backend that detokenizes with agentx's tokenizer (agentx's core, the vLLM
backend), so the streamed text and where a stop string ends it are the same on both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentx.engine.models.detokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class TextState:
    """Incremental text of one request, holding back what may be the start of a stop string."""

    detok: IncrementalDetokenizer
    stop: tuple[str, ...]
    include_stop: bool
    text: str = ""
    num_emitted: int = 0
    matched: str | None = field(default=None)

    def push(self, token_ids: list[int]) -> str:
        self.text += self.detok.push(token_ids)
        if self.stop and self.matched is None:
            self._find_stop()
        if self.matched is not None:
            end = len(self.text)
        else:
            hold = max((len(s) - 1 for s in self.stop), default=0)
            end = max(self.num_emitted, len(self.text) - hold)
        new, self.num_emitted = self.text[self.num_emitted : end], end
        return new

    def flush(self) -> str:
        """At the finish: emit everything held back, incomplete characters included."""
        if self.matched is None:
            self.text += self.detok.flush()
        new, self.num_emitted = self.text[self.num_emitted :], len(self.text)
        return new

    def _find_stop(self) -> None:
        window = max(len(s) for s in self.stop) + 16
        start = max(0, self.num_emitted - window)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            i, s = min(hits)
            self.matched = s
            self.text = self.text[: i + len(s) if self.include_stop else i]
