"""Statistics of a trace, computed from the trace alone (no engine involved): hit rates from its
hash ids, and the wall time its think times alone take (:func:`think_bound`).

Theoretical prefix hit rate, the definition used everywhere in ``agentx.bench``::

    walk the requests in trace order (sessions in file order, each session tree depth-first);
    a prompt token is a hit when the block holding it (its ``hash_id``, in its session's scope)
    already appeared in an earlier request of the trace; a block covers ``block_size`` tokens,
    the last block of a prompt the rest;
    hit rate = hit tokens / all prompt tokens.

It is what an engine with an unbounded cache of ``block_size``-token blocks could reuse; it does
not require the hit blocks to form a prefix. The total number of hit blocks does not depend on
the order of requests, only which request gets them.
"""

from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass

from agentx.bench.trace import SessionTrace, Step, Trace, TraceRequest, group_steps
from agentx.errors import ConfigError


def block_sizes(request: TraceRequest, block_size: int) -> list[int]:
    """Tokens covered by each of the request's blocks (the last one may be partial; ids beyond
    the prompt cover nothing, tokens beyond the ids are in no block)."""
    n = request.num_input_tokens
    return [max(0, min(block_size, n - i * block_size)) for i in range(len(request.hash_ids))]


class HitCounter:
    """Counts theoretical hit tokens request by request, in the order they are fed."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._seen: set[int | tuple[str, int]] = set()

    def feed(self, session: SessionTrace, request: TraceRequest) -> int:
        """Hit tokens of ``request``; then its blocks count as seen."""
        scope, bs, seen = session.scope, self.block_size, self._seen
        keys = [(scope, h) for h in request.hash_ids] if scope else request.hash_ids
        num_full = min(len(keys), request.num_input_tokens // bs)
        hits = sum(map(seen.__contains__, keys[:num_full])) * bs
        for i in range(num_full, len(keys)):  # the partial last block, or ids past the prompt
            if keys[i] in seen:
                hits += max(0, min(bs, request.num_input_tokens - i * bs))
        seen.update(keys)
        return hits


def theoretical_hits(trace: Trace) -> list[int]:
    """Hit tokens of every request, in :meth:`Trace.iter_requests` order."""
    counter = HitCounter(trace.block_size)
    return [counter.feed(s, r) for s, r in trace.iter_requests()]


@dataclass(frozen=True, slots=True)
class TraceStats:
    num_sessions: int
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    theoretical_hit_tokens: int
    median_turns: float  # model requests of the root agent, per session
    median_input_tokens: float  # per request, subagents' included
    median_output_tokens: float
    max_input_tokens: int
    subagent_session_fraction: float  # sessions that spawn at least one subagent
    median_subagents: float  # subagents per session, among sessions that spawn any

    @property
    def theoretical_hit_rate(self) -> float:
        p = self.num_prompt_tokens
        return self.theoretical_hit_tokens / p if p else 0.0

    def to_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.__slots__}
        out["theoretical_hit_rate"] = self.theoretical_hit_rate
        return out


def trace_stats(trace: Trace) -> TraceStats:
    requests = [r for _, r in trace.iter_requests()]
    turns = [sum(isinstance(s, TraceRequest) for s in x.steps) for x in trace.sessions]
    spawns = [sum(1 for _ in x.iter_subagents()) for x in trace.sessions]
    with_subagents = [n for n in spawns if n]
    return TraceStats(
        num_sessions=len(trace.sessions),
        num_requests=len(requests),
        num_prompt_tokens=sum(r.num_input_tokens for r in requests),
        num_output_tokens=sum(r.num_output_tokens for r in requests),
        theoretical_hit_tokens=sum(theoretical_hits(trace)),
        median_turns=_median(turns),
        median_input_tokens=_median([r.num_input_tokens for r in requests]),
        median_output_tokens=_median([r.num_output_tokens for r in requests]),
        max_input_tokens=max((r.num_input_tokens for r in requests), default=0),
        subagent_session_fraction=len(with_subagents) / len(spawns) if spawns else 0.0,
        median_subagents=_median(with_subagents),
    )


def think_bound(trace: Trace, concurrency: int, max_think: float) -> float:
    """Seconds the replay of ``trace`` takes at ``concurrency`` on an engine that takes no time:
    the think times alone, scheduled as :mod:`agentx.bench.replay` schedules them (sessions in
    trace order on ``concurrency`` slots, each as soon as one frees; an agent's steps in order,
    each pausing ``min(think_time, max_think)``; a group of subagents as long as its longest).
    No engine's wall time is shorter, so ``(prompt + output tokens) / think_bound`` bounds TPGS."""
    if concurrency <= 0:
        raise ConfigError(f"concurrency must be positive, got {concurrency}")
    slots = [0.0] * min(concurrency, max(1, len(trace.sessions)))
    wall = 0.0
    for session in trace.sessions:
        end = heapq.heappop(slots) + _agent_think(session.steps, max_think)
        heapq.heappush(slots, end)
        wall = max(wall, end)
    return wall


def _agent_think(steps: tuple[Step, ...], max_think: float) -> float:
    total = 0.0
    for step in group_steps(steps):
        if isinstance(step, tuple):
            total += max(_agent_think(s.steps, max_think) for s in step)
        elif step.think_time > 0 and max_think > 0:
            total += min(step.think_time, max_think)
    return total


def _median(values: list[int]) -> float:
    return float(statistics.median(values)) if values else 0.0
