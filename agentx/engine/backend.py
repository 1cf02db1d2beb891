"""EngineBackend: the one engine interface the Session depends on, and its capability record.

A Session talks to an engine only through this interface: token-id prompts in, streamed deltas
out (:class:`RequestStream`), a finished turn's KV held for the next turn (``hold_kv`` /
``held_kv`` on :class:`RequestOptions`), forks of held KV, priority, cache salt, abort,
per-request cached-token counts (on every :class:`RequestOutput`), structured-output constraints
(``SamplingParams.structured``), hints and stats. Two implementations: agentx's own
:class:`~agentx.engine.client.Engine` and the vLLM backend (``agentx.engine.vllm``), both on the
loop-thread base :class:`~agentx.engine.loop_backend.LoopBackend`.

What a backend cannot honour it says in :meth:`EngineBackend.capabilities`, and warns once the
first time a request asks for it: a hint is never dropped silently. This module knows nothing
about schedulers, blocks or vLLM.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

from agentx.engine.hints import BranchPoint, Hint, Pin, Priority, Release, ToolLatency, TurnsLeft

if TYPE_CHECKING:  # request.py imports the KV cache, which imports back into the engine
    from agentx.engine.models.tokenizer import Tokenizer
    from agentx.engine.outputs import EngineStats
    from agentx.engine.request import RequestOptions
    from agentx.engine.sampling import SamplingParams
    from agentx.engine.streams import RequestStream

__all__ = ["EngineBackend", "EngineCapabilities", "Prompt", "UnsupportedWarnings"]

logger = logging.getLogger("agentx.engine")

Prompt = str | Sequence[int]  # text, or token ids


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """What one backend does with each part of the interface (True: honoured as documented).

    ``exact_held_kv``: held KV is kept whole until released, so the next turn computes exactly
    its new tokens (agentx). False: held KV is best effort through an automatic prefix cache
    (whole blocks of ``block_size`` tokens, evictable), the next turn may compute more.
    """

    name: str
    block_size: int  # the prefix-cache unit: cached-token counts are multiples of it (or exact)
    exact_held_kv: bool = True
    fork_held: bool = True  # forks share the parent's KV (by reference, or by the prefix cache)
    priority: bool = True  # lower priority runs first
    cache_salt: bool = True  # a salt isolates prefix-cache entries
    structured_outputs: bool = True  # SamplingParams.structured is enforced by masking
    grammar_budget: bool = True  # a grammar is closed complete within max_tokens
    pin: bool = True  # Pin(): held KV is never released for room
    release_drop_cached: bool = True  # Release(): a closed session's cached blocks are dropped
    tool_latency: bool = True  # ToolLatency(): demote while the tool runs, prefetch back
    draft_from_context: bool = True  # speculative decoding from the session tree's context
    export_held: bool = True  # export_held / import_held through shared offload tiers
    session_affinity: bool = True  # a session stays on the replica holding its cache (DP > 1)
    branch_point: bool = True  # BranchPoint(n): the fork point's KV is kept for its forks
    turns_left: bool = True  # TurnsLeft(k): fewer turns left, held KV released first

    def honours(self, hint: Hint) -> bool:
        """Whether this backend acts on ``hint`` (one it does not is still accepted)."""
        if isinstance(hint, Priority):
            return self.priority
        if isinstance(hint, Pin):
            return self.pin
        if isinstance(hint, Release):
            return self.release_drop_cached or not hint.drop_cached
        if isinstance(hint, ToolLatency):
            return self.tool_latency
        if isinstance(hint, BranchPoint):
            return self.branch_point
        if isinstance(hint, TurnsLeft):
            return self.turns_left
        return False

    def unsupported(self) -> list[str]:
        """Names of the boolean capabilities this backend does not have."""
        return [
            name
            for name in self.__slots__
            if name not in ("name", "block_size") and getattr(self, name) is False
        ]


class UnsupportedWarnings:
    """One warning per (backend, feature) for what a backend cannot honour. Thread-safe."""

    def __init__(self, backend: str) -> None:
        self._backend = backend
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def warn(self, feature: str, detail: str) -> bool:
        """Log ``detail`` the first time ``feature`` is asked for; True if it logged now."""
        with self._lock:
            if feature in self._warned:
                return False
            self._warned.add(feature)
        logger.warning("%s backend: %s is not honoured: %s", self._backend, feature, detail)
        return True

    @property
    def warned(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._warned)


class EngineBackend(abc.ABC):
    """An engine a Session can drive. Every method may be called from any thread unless it
    says otherwise; none blocks on a step except where it says it waits.

    Attributes every backend sets before its constructor returns:
        ``tokenizer``: agentx's :class:`~agentx.engine.models.tokenizer.Tokenizer` of the model
        (the chat template and token ids are agentx's on every backend).
        ``max_model_len``: the model context in tokens.
    """

    tokenizer: Tokenizer
    max_model_len: int

    @abc.abstractmethod
    def add_request(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        options: RequestOptions | None = None,
    ) -> RequestStream:
        """Validate and queue a request; its deltas arrive on the returned stream.

        Raises InvalidRequestError (PromptTooLongError, ...) on the caller's thread, before
        anything is queued. ``options.hold_kv``: when the request completes its KV is held under
        its request id (the handle) for a later request passing ``held_kv=handle`` whose prompt
        extends this request's prompt and output; that request adopts the hold (the handle is
        gone after it). Every delta carries ``num_cached_tokens``: prompt tokens not computed.
        A request that is aborted fails its stream with RequestAbortedError; a closed engine
        fails live streams with EngineClosedError, a crashed one with EngineDeadError."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a live request (no-op if it is not live); idempotent, never blocks."""

    @abc.abstractmethod
    def fork_held(self, handle: str, num_forks: int) -> list[str]:
        """``num_forks`` new handles continuing held KV ``handle`` (the original stays).
        Returns [] if the handle is gone or there is no room. May wait for the loop."""

    @abc.abstractmethod
    def release_held_soon(self, handle: str, drop_cached: bool = False) -> None:
        """Release held KV before the next step, without waiting. Unknown handles: no-op."""

    @abc.abstractmethod
    def release_held_eventually(self, handle: str) -> None:
        """Like ``release_held_soon`` but never takes a lock that a stream holds: a garbage
        collector's finalizer calls it on whatever thread collected."""

    @abc.abstractmethod
    def pin_held_soon(self, handle: str, pinned: bool = True) -> None:
        """Keep (or stop keeping) held KV from being released for room; without waiting."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters (fields a backend cannot see are 0)."""

    @abc.abstractmethod
    def capabilities(self) -> EngineCapabilities:
        """What this backend honours (constant for the engine's life)."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Assert the backend's bookkeeping is consistent (tests call it when idle)."""

    @abc.abstractmethod
    def get_num_live_requests(self) -> int:
        """Requests added and not yet finished."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the engine; live requests fail with EngineClosedError. Idempotent."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether ``close()`` was called."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
