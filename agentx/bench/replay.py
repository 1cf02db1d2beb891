"""Replay a trace against one engine: session trees, bounded concurrency, think time.

Rules:
- Concurrency is the number of live session trees. Sessions start in trace order as slots free
  up (closed loop; recorded arrival times are not used).
- An agent runs its steps in order. Before each request it pauses ``think_time`` (capped at
  ``max_think``). A run of consecutive subagents starts together, and the parent's next step
  waits until all of them finished; subagents nest.
- Every request asks for exactly its trace's output length (greedy, EOS ignored).
- Prompts come from a :class:`~agentx.bench.prompts.PromptSource` (text or random ids). In
  ``loop="closed"`` a turn that extends its agent's previous turn is sent as that prompt, the
  ids the engine generated, then the new text (:mod:`agentx.bench.closed_loop`); an engine that
  returns no ids fails the request. ``loop="open"`` builds every prompt from its hash ids.
- When a session tree is finished, ``end_session`` is sent for each of its agents.
- ``stop()`` (Ctrl-C) starts no new request, cancels what is running and returns what was
  measured so far, marked ``interrupted``. A failed request is recorded with its error.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from agentx.bench.adapter import (
    BenchEngineError,
    Done,
    EngineAdapter,
    EngineInfo,
    GenerateRequest,
    Tokens,
)
from agentx.bench.closed_loop import AgentContext
from agentx.bench.prompts import PromptBuilder, PromptSource
from agentx.bench.records import RequestRecord, RunResult
from agentx.bench.segments import Prompt
from agentx.bench.trace import SessionTrace, Step, Subagent, Trace, TraceRequest, group_steps
from agentx.bench.trace_stats import HitCounter
from agentx.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    concurrency: int = 8
    max_think: float = 5.0  # seconds; 0 replays back to back
    progress: bool = True
    loop: str = "open"  # "closed": a turn's prompt carries the engine's earlier output

    def __post_init__(self) -> None:
        if self.loop not in ("open", "closed"):
            raise ConfigError(f"loop must be 'open' or 'closed', got {self.loop!r}")
        if self.concurrency <= 0:
            raise ConfigError(f"concurrency must be positive, got {self.concurrency}")
        if self.max_think < 0:
            raise ConfigError(f"max_think must be >= 0, got {self.max_think}")


class Replay:
    def __init__(
        self,
        trace: Trace,
        adapter: EngineAdapter,
        config: ReplayConfig | None = None,
        prompts: PromptSource | None = None,
    ) -> None:
        self.trace, self.adapter = trace, adapter
        self.config = config or ReplayConfig()
        self.prompts = prompts or PromptBuilder(trace.block_size)
        self.records: list[RequestRecord] = []
        self._hits = self._theoretical_hits()
        self._t0 = 0.0
        self._main: asyncio.Task | None = None
        self._stopped = False
        self._counts: dict[str, int] = {}  # requests sent per agent
        self._bar = None

    def _theoretical_hits(self) -> dict[int, int]:
        counter = HitCounter(self.trace.block_size)
        return {id(r): counter.feed(s, r) for s, r in self.trace.iter_requests()}

    def stop(self) -> None:
        """Stop now (safe from a signal handler on the event loop's thread)."""
        self._stopped = True
        if self._main is not None:
            self._main.cancel()

    async def run(self, info: EngineInfo) -> RunResult:
        """Replay the whole trace on a started adapter."""
        from tqdm.auto import tqdm

        total = self.trace.num_requests
        self._bar = tqdm(total=total, unit="req", disable=not self.config.progress, leave=False)
        self._t0 = time.perf_counter()
        self._main = asyncio.current_task()
        try:
            await self._run_sessions()
        except asyncio.CancelledError:
            if not self._stopped:
                raise
            self._main.uncancel()
        finally:
            self._bar.close()
        wall = max((r.end_time for r in self.records), default=0.0)
        return RunResult(
            engine=info,
            concurrency=self.config.concurrency,
            wall_time=wall,
            records=tuple(sorted(self.records, key=lambda r: r.submit_time)),
            interrupted=self._stopped,
            num_requests_planned=total,
        )

    async def _run_sessions(self) -> None:
        slots = asyncio.Semaphore(self.config.concurrency)
        tasks = []

        async def one(session: SessionTrace) -> None:
            try:
                await self._run_agent(
                    session, session.session_id, session.steps, self._new_context()
                )
                for agent_id in _agent_ids(session):
                    try:
                        await self.adapter.end_session(agent_id)
                    except BenchEngineError:
                        pass  # a dead engine already failed (and recorded) its requests
            finally:
                slots.release()

        try:
            for session in self.trace.sessions:
                await slots.acquire()
                tasks.append(asyncio.create_task(one(session)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _new_context(self) -> AgentContext | None:
        return AgentContext() if self.config.loop == "closed" else None

    async def _run_agent(
        self,
        session: SessionTrace,
        agent_id: str,
        steps: tuple[Step, ...],
        context: AgentContext | None,
    ):
        for step in group_steps(steps):
            if isinstance(step, tuple):  # subagents fork the parent's context at the spawn
                await asyncio.gather(
                    *(
                        self._run_agent(
                            session, f"{agent_id}/{s.agent_id}", s.steps, context and context.fork()
                        )
                        for s in step
                    )
                )
            else:
                if step.think_time > 0 and self.config.max_think > 0:
                    await asyncio.sleep(min(step.think_time, self.config.max_think))
                await self._run_request(session, agent_id, step, context)

    def _prompt(
        self,
        session: SessionTrace,
        request: TraceRequest,
        request_id: str,
        context: AgentContext | None,
    ) -> Prompt:
        if context is not None:
            return context.prompt_for(request, self.prompts, session.scope, request_id)
        n = request.num_input_tokens
        return Prompt((self.prompts.segment(session.scope, request.hash_ids, n, request_id),))

    async def _run_request(
        self,
        session: SessionTrace,
        agent_id: str,
        request: TraceRequest,
        context: AgentContext | None,
    ):
        index = self._counts[agent_id] = self._counts.get(agent_id, -1) + 1
        request_id = f"{agent_id}#{index}"
        prompt = self._prompt(session, request, request_id, context)
        generate = GenerateRequest(
            request_id, agent_id, prompt, request.num_output_tokens, context is not None
        )
        now = self._now
        submit, times, cached, error, output = now(), [], None, None, None
        try:
            async for event in self.adapter.generate(generate):
                if isinstance(event, Tokens):
                    times.extend([now()] * event.n)
                elif isinstance(event, Done):
                    cached, output = event.num_cached, event.token_ids
        except Exception as exc:  # noqa: BLE001 - a failed request is a measurement too
            error = f"{type(exc).__name__}: {exc}"
        if context is not None:
            if error is None and output is None:
                error = "closed loop: the engine returned no output token ids"
            if error is None:
                context.complete(request, prompt, output)
            else:
                context.reset()
        self.records.append(
            RequestRecord(
                request_id=request_id,
                session_id=session.session_id,
                agent_id=agent_id,
                num_prompt_tokens=request.num_input_tokens,
                num_output_tokens=len(times),
                num_cached_tokens=cached,
                theoretical_hit_tokens=self._hits.get(id(request), 0),
                submit_time=submit,
                token_times=tuple(times),
                end_time=now(),
                error=error,
            )
        )
        self._bar.update(1)

    def _now(self) -> float:
        return time.perf_counter() - self._t0


def _agent_ids(session: SessionTrace) -> list[str]:
    ids = [session.session_id]

    def walk(prefix: str, steps: tuple[Step, ...]) -> None:
        for step in steps:
            if isinstance(step, Subagent):
                ids.append(f"{prefix}/{step.agent_id}")
                walk(ids[-1], step.steps)

    walk(session.session_id, session.steps)
    return ids
