"""How long one API request took, as the metrics count it: a leaf record and its clock.

The service ticks a :class:`RequestClock` on every engine delta and hands the finished
:class:`RequestTiming` to whoever listens (the server's Prometheus histograms). It does not
know Prometheus or HTTP.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RequestClock", "RequestTiming", "TimingSink"]


@dataclass(frozen=True, slots=True)
class RequestTiming:
    route: str  # "chat", "completions", "responses"
    ttft_s: float | None  # None: no token came out
    e2e_s: float
    inter_token_s: tuple[float, ...]  # one gap per output token after the first
    num_prompt_tokens: int
    num_output_tokens: int


TimingSink = Callable[[RequestTiming], None]


class RequestClock:
    """Started when a request is accepted; ``tick`` on each delta's new tokens."""

    __slots__ = ("_first", "_gaps", "_last", "_start", "num_output_tokens")

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._first: float | None = None
        self._last = 0.0
        self._gaps: list[float] = []
        self.num_output_tokens = 0

    def tick(self, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        now = time.perf_counter()
        if self._first is None:
            self._first = now
            num_gaps = num_new_tokens - 1
            gap = 0.0
        else:
            num_gaps, gap = num_new_tokens, (now - self._last) / num_new_tokens
        self._gaps += [gap] * num_gaps  # drafted tokens of one step share its gap
        self._last = now
        self.num_output_tokens += num_new_tokens

    def finish(self, route: str, num_prompt_tokens: int) -> RequestTiming:
        now = time.perf_counter()
        ttft = None if self._first is None else self._first - self._start
        gaps, num_out = tuple(self._gaps), self.num_output_tokens
        return RequestTiming(route, ttft, now - self._start, gaps, num_prompt_tokens, num_out)
