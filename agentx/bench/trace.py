"""The typed trace model: what a benchmark replays, independent of the file it came from.

A :class:`Trace` is a list of session trees. A session is an agent's ordered steps; a step is a
model request (:class:`TraceRequest`) or a subagent (:class:`Subagent`), which is itself an agent
with its own steps. Prompts are described only by their sizes and by ``hash_ids``: one id per
``block_size``-token block of the prompt, equal ids meaning equal content (the last block may be
partial). Nothing here knows about JSON, engines or token ids.

Replay semantics (see :mod:`agentx.bench.replay`): an agent runs its steps in order; a maximal run
of consecutive subagents forms one parallel group, and the step after the group starts when every
subagent of the group has finished (a parent waits for its subagents).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One model call: ``num_input_tokens`` of prompt described by ``hash_ids``, then exactly
    ``num_output_tokens`` of output. ``think_time`` (s) is the pause before it is sent, after the
    agent's previous step ended (tool execution, the user)."""

    t: float  # seconds since the start of its session, as recorded
    num_input_tokens: int
    num_output_tokens: int
    hash_ids: tuple[int, ...]
    think_time: float = 0.0
    kind: str = "n"  # the trace's request type ("n", "s")
    api_time: float | None = None  # recorded latency of the call, seconds
    stop: str | None = None
    input_types: tuple[str, ...] = ()
    output_types: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Subagent:
    """A child agent spawned by its parent; its prompts usually fork from the parent's context."""

    t: float
    agent_id: str
    steps: tuple[Step, ...]
    subagent_type: str = ""
    duration_ms: float | None = None

    def iter_requests(self) -> Iterator[TraceRequest]:
        yield from _iter_requests(self.steps)


Step = TraceRequest | Subagent


@dataclass(frozen=True, slots=True)
class SessionTrace:
    """One root agent and everything it spawned. ``scope`` namespaces its hash ids: sessions
    with equal scopes share block content; the empty scope is the trace-wide namespace."""

    session_id: str
    steps: tuple[Step, ...]
    scope: str = ""
    start_time: float = 0.0  # recorded arrival, seconds since the trace start (Mooncake)
    system_tokens: int = 0
    tool_tokens: int = 0

    def iter_requests(self) -> Iterator[TraceRequest]:
        yield from _iter_requests(self.steps)

    def iter_subagents(self) -> Iterator[Subagent]:
        yield from _iter_subagents(self.steps)


@dataclass(frozen=True, slots=True)
class Trace:
    trace_id: str
    block_size: int
    sessions: tuple[SessionTrace, ...]
    source_format: str = "agentx"  # "agentx" (SemiAnalysis / weka JSON) or "mooncake"
    meta: dict = field(default_factory=dict, compare=False)  # e.g. the synthesis config

    def iter_requests(self) -> Iterator[tuple[SessionTrace, TraceRequest]]:
        """Every request in trace order: sessions in order, each tree depth-first."""
        for session in self.sessions:
            for request in session.iter_requests():
                yield session, request

    @property
    def num_requests(self) -> int:
        return sum(1 for _ in self.iter_requests())


def _iter_requests(steps: tuple[Step, ...]) -> Iterator[TraceRequest]:
    for step in steps:
        if isinstance(step, Subagent):
            yield from step.iter_requests()
        else:
            yield step


def _iter_subagents(steps: tuple[Step, ...]) -> Iterator[Subagent]:
    for step in steps:
        if isinstance(step, Subagent):
            yield step
            yield from _iter_subagents(step.steps)


def group_steps(steps: tuple[Step, ...]) -> list[TraceRequest | tuple[Subagent, ...]]:
    """Split an agent's steps into requests and parallel groups of consecutive subagents."""
    out: list[TraceRequest | tuple[Subagent, ...]] = []
    for step in steps:
        if isinstance(step, Subagent):
            if out and isinstance(out[-1], tuple):
                out[-1] = (*out[-1], step)
            else:
                out.append((step,))
        else:
            out.append(step)
    return out
