"""Per-request output streams: the hand-off from the engine loop thread to callers.

The engine thread ``put``s deltas without ever blocking; a caller consumes them synchronously
(``result()``) or asynchronously (``async for``) under asyncio or trio. An async consumer is
woken through its own event loop's thread-safe callback, so the engine thread never waits on
a caller.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from agentx.engine.outputs import RequestOutput, TokenLogprob
from agentx.engine.sampling import SamplingParams
from agentx.errors import RequestFailedError


@dataclass(frozen=True, slots=True)
class RequestUsage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    output_tokens: int
    draft_tokens: int = 0  # tokens drafted from context and verified (engine/draft.py)
    accepted_draft_tokens: int = 0  # of those, accepted (output tokens that cost no step)

    @property
    def computed_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True, slots=True)
class Generation:
    """A finished request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    usage: RequestUsage
    # with SamplingParams.logprobs: one record per token of token_ids; else None
    logprobs: list[TokenLogprob] | None = None
    # with SamplingParams.prompt_logprobs: one per prompt token (None for the first); else None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def _threadsafe_setter(event: anyio.Event) -> Callable[[], None]:
    """A callable any thread may call to set ``event`` in the running event loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio: anyio's other backend is trio
        import trio

        token = trio.lowlevel.current_trio_token()
        return lambda: token.run_sync_soon(event.set)
    return lambda: loop.call_soon_threadsafe(event.set)


class RequestStream:
    """Deltas of one request, in order, ending with a finished delta or an error."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        wants_logprobs: bool = False,
        wants_prompt_logprobs: bool = False,
    ) -> None:
        self.request_id = request_id
        self.wants_logprobs = wants_logprobs
        self.wants_prompt_logprobs = wants_prompt_logprobs
        self.prompt_token_ids = prompt_token_ids
        self._items: deque[RequestOutput] = deque()
        self._error: BaseException | None = None
        self._done = False
        self._cond = threading.Condition()
        self._notify: Callable[[], None] | None = None
        self._on_finish: list[Callable[[RequestOutput | None], None]] | None = []
        self._final_put: RequestOutput | None = None  # the finished delta, once produced
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.text = ""
        self.final: RequestOutput | None = None

    @classmethod
    def for_sampling(
        cls, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> RequestStream:
        """A stream whose generation carries the logprobs ``sampling`` asks for."""
        return cls(
            request_id,
            prompt_token_ids,
            wants_logprobs=sampling.logprobs is not None,
            wants_prompt_logprobs=sampling.prompt_logprobs is not None,
        )

    # ---- producer side (engine thread) -------------------------------------------------------

    def put(self, output: RequestOutput) -> None:
        with self._cond:
            self._items.append(output)
            self._wake()
        if output.finished:
            self._finish(output)

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._wake()
        self._finish(None)

    def add_finish_callback(self, callback: Callable[[RequestOutput | None], None]) -> None:
        """Call ``callback(final)`` (None: the request failed) once, on the producer's thread,
        when the request ends (at once, on this thread, if it already has). It must not block
        or raise: it runs inside the engine's step (a router queues work for its own thread)."""
        with self._cond:
            if self._on_finish is not None:
                self._on_finish.append(callback)
                return
            final = self._final_put
        callback(final)

    def _finish(self, final: RequestOutput | None) -> None:
        with self._cond:
            callbacks, self._on_finish = self._on_finish or [], None
            self._final_put = self._final_put or final
        for callback in callbacks:
            callback(final)

    def _wake(self) -> None:
        self._cond.notify_all()
        if self._notify is not None:
            notify, self._notify = self._notify, None
            try:
                notify()
            except RuntimeError:
                pass  # the consumer's event loop is gone; nobody is waiting any more

    # ---- consumer side -----------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self._done

    def _take(self) -> RequestOutput | None:
        """Next delta if one is ready; raises the stream's error once deltas run out."""
        if self._items:
            out = self._items.popleft()
            self.token_ids.extend(out.new_token_ids)
            self.logprobs.extend(out.logprobs)
            self.prompt_logprobs.extend(out.prompt_logprobs)
            self.text += out.new_text
            if out.finished:
                self._done, self.final = True, out
                if out.finish_reason == "error":
                    raise RequestFailedError(
                        f"request {self.request_id} failed while it ran "
                        f"(stop reason {out.stop_reason!r})",
                        out,
                    )
            return out
        if self._error is not None:
            self._done = True
            raise self._error
        return None

    def get(self, timeout: float | None = None) -> RequestOutput:
        with self._cond:
            while (out := self._take()) is None:
                if not self._cond.wait(timeout):
                    raise TimeoutError(f"no output from request {self.request_id} in {timeout}s")
            return out

    async def aget(self) -> RequestOutput:
        while True:
            with self._cond:
                out = self._take()
                if out is not None:
                    return out
                event = anyio.Event()
                notify = self._notify = _threadsafe_setter(event)
            try:
                await event.wait()
            finally:
                with self._cond:
                    if self._notify is notify:  # cancelled: leave no callback into our loop
                        self._notify = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        return await self.aget()

    def result(self, timeout: float | None = None) -> Generation:
        """Block until the request finishes."""
        while not self._done:
            self.get(timeout)
        return self.to_generation()

    def to_generation(self) -> Generation:
        final = self.final
        assert final is not None, "request has not finished"
        return Generation(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.token_ids),
            text=self.text,
            finish_reason=final.finish_reason,
            stop_reason=final.stop_reason,
            usage=RequestUsage(
                final.num_prompt_tokens,
                final.num_cached_tokens,
                final.num_output_tokens,
                final.num_draft_tokens,
                final.num_accepted_tokens,
            ),
            logprobs=list(self.logprobs) if self.wants_logprobs else None,
            prompt_logprobs=list(self.prompt_logprobs) if self.wants_prompt_logprobs else None,
        )
