"""The engine interface the replay drives, and the records it exchanges.

An adapter wraps one engine (in-process, or a worker subprocess speaking
:mod:`agentx.bench.protocol`). The replay calls ``start`` once, then ``generate`` for many
requests concurrently (from one asyncio event loop), ``end_session`` when a session tree is over,
and ``close`` once at the end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from agentx.bench.segments import Prompt


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """``prompt`` is token ids, or segments whose text the adapter tokenizes with its engine's
    own tokenizer (:mod:`agentx.bench.segments`). ``return_ids``: ``Done`` carries the output's
    token ids (the closed loop feeds them into the agent's next prompt)."""

    request_id: str
    session_id: str  # the agent (root or subagent) the request belongs to
    prompt: list[int] | Prompt
    max_tokens: int
    return_ids: bool = False


@dataclass(frozen=True, slots=True)
class Tokens:
    """``n`` new output tokens, produced since the previous event of the request."""

    n: int


@dataclass(frozen=True, slots=True)
class Done:
    """The request finished; ``num_cached`` prompt tokens came from the engine's cache (None:
    the engine does not say); ``token_ids``: the output, when the request asked for it."""

    num_output: int
    num_cached: int | None
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class EngineInfo:
    engine: str
    version: str
    config: dict = field(default_factory=dict)


class EngineAdapter(ABC):
    """One engine under test.

    Contract:
    - ``start`` loads the engine (model, threads) and returns what it is; nothing else is called
      before it. It may take seconds to minutes; the replay clock starts after it.
    - ``generate`` yields :class:`Tokens` as output is produced (the caller timestamps them on
      receipt), then exactly one :class:`Done`. Output is greedy, ignores EOS and is exactly
      ``max_tokens`` long; with ``return_ids`` the ``Done`` carries its token ids. A prompt of
      :class:`Prompt` segments is tokenized by the adapter (its engine's tokenizer, segment by
      segment). Many ``generate`` streams may be open at once. Cancelling the
      iteration aborts the request. Failures raise :class:`BenchEngineError`.
    - ``end_session`` tells the engine a session will send nothing more (it may free its cache);
      it must not fail for unknown sessions.
    - ``final_stats`` (optional) reports the engine's own counters after the run.
    - ``close`` releases everything; idempotent; safe after a failed ``start``.
    """

    name: str = "engine"

    @abstractmethod
    async def start(self) -> EngineInfo: ...

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[Tokens | Done]: ...

    async def end_session(self, session_id: str) -> None:  # noqa: B027 - optional hook
        """Default: nothing to free."""

    async def final_stats(self) -> dict | None:
        """The engine's own counters after a run (prefix-cache hits, preemptions, ...), when it
        exposes them; called once before ``close``. Default: None."""
        return None

    @abstractmethod
    async def close(self) -> None: ...


class BenchEngineError(RuntimeError):
    """The engine under test failed a request (the replay records it and goes on)."""


async def agentx_events(
    outputs: AsyncIterator, return_ids: bool = False
) -> AsyncIterator[Tokens | Done]:
    """An agentx stream's outputs as bench events; an agentx error becomes BenchEngineError."""
    from agentx import AgentXError  # imported here: the adapter layer knows no engine

    output: list[int] = []
    try:
        async for out in outputs:
            if out.new_token_ids:
                output.extend(out.new_token_ids)
                yield Tokens(len(out.new_token_ids))
            if out.finished:
                ids = tuple(output) if return_ids else None
                yield Done(len(output), out.num_cached_tokens, ids)
    except AgentXError as exc:
        raise BenchEngineError(str(exc)) from exc
