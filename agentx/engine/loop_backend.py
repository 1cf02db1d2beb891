"""LoopBackend: the loop-thread plumbing every in-process backend shares.

A backend that drives its engine from one background thread (agentx's own
:class:`~agentx.engine.client.Engine`, the vLLM backend) gets from this base: the request
queue the caller's thread fills and the loop drains, request ids, the live streams, aborts,
``generate`` / ``stream`` / ``complete``, death (every live stream fails with
:class:`EngineDeadError`) and close (they fail with :class:`EngineClosedError`).

Each backend keeps what differs: admission (:meth:`LoopBackend._admit` validates a request on
the caller's thread) and its step (:meth:`LoopBackend._step`, on the loop thread, with what the
callers queued since the last step). This module knows nothing about schedulers or vLLM.

    caller threads                       loop thread (_run_steps)
    add_request -> _admit ┐
    abort ────────────────┼─ _cond ──>  _loop_once: wait, drain (_new, _aborts)
    close ────────────────┘                         -> _step(new, aborts) -> streams
"""

from __future__ import annotations

import abc
import itertools
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Generic, TypeVar, cast

from agentx.engine.backend import EngineBackend, Prompt
from agentx.engine.outputs import RequestOutput
from agentx.engine.request import RequestOptions
from agentx.engine.sampling import SamplingParams
from agentx.engine.streams import Generation, RequestStream
from agentx.errors import EngineClosedError, EngineDeadError, InvalidRequestError, warn_renamed

__all__ = ["LoopBackend"]

QueuedT = TypeVar("QueuedT")  # what add_request queues for the loop (a backend's own record)


class LoopBackend(EngineBackend, Generic[QueuedT]):
    """An :class:`EngineBackend` stepped by one loop thread of its own.

    Locks: ``_cond`` guards the queue (``_new``, ``_aborts``), ``_streams``, ``_closed`` and
    ``_dead``; the loop holds ``_step_lock`` while it touches the engine, so a caller's thread
    may take it to read or change the engine between steps. Where both are needed, ``_cond``
    is taken first.

    A subclass calls ``super().__init__()`` first, starts ``_thread`` (whose target ends in
    :meth:`_run_steps`) and implements :meth:`_admit`, :meth:`_step` and :meth:`_has_work`.
    """

    _loop_name = "engine"  # in error messages: "the <name> loop crashed"
    _thread: threading.Thread

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()  # held by the loop while it touches the engine
        self._new: list[QueuedT] = []
        self._aborts: list[str] = []
        self._streams: dict[str, RequestStream] = {}  # live requests, under _cond
        self._ids = itertools.count()
        self._closed = False
        self._dead: BaseException | None = None

    # ---- the step: what each backend implements ----------------------------------------------

    @abc.abstractmethod
    def _step(self, new: list[QueuedT], aborts: list[str]) -> None:
        """On the loop thread, without ``_cond``: admit ``new``, abort ``aborts`` (ids that were
        live when aborted), run one step and hand its deltas to the streams. Raising kills the
        backend (every live stream fails with EngineDeadError)."""

    @abc.abstractmethod
    def _has_work(self) -> bool:
        """Under ``_cond``: whether the loop should step though nothing new was queued."""

    def _before_steps(self) -> None:
        """On the loop thread, before its first step (a warm-up); raising kills the backend."""

    def _on_close(self) -> None:
        """On the loop thread after ``close()``, before the live streams fail."""

    def _after_steps(self) -> None:
        """On the loop thread as it ends, closed or dead: release the engine (must not raise)."""

    @abc.abstractmethod
    def _admit(
        self, rid: str, prompt: Prompt, sampling: SamplingParams, options: RequestOptions
    ) -> tuple[RequestStream, QueuedT]:
        """On the caller's thread: validate the request (raise InvalidRequestError) and build
        its stream and what the loop admits in its next step. Queues nothing."""

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        options: RequestOptions | None = None,
        **fields: object,
    ) -> RequestStream:
        """Validate and queue a request; its deltas arrive on the returned stream.

        ``options`` is a :class:`RequestOptions`; its fields may also be given as keywords
        (``priority=-1``, ``cache_salt="tenant-a"``, ``hold_kv=True``, ``held_kv=handle``,
        ``hints=(...)``), which override those of ``options``.

        ``hold_kv``: when it finishes, its KV is held under its request id (the handle) for a
        later request that passes it as ``held_kv`` and whose prompt starts with this request's
        prompt and output; that request then computes only what is new (on a backend without
        ``exact_held_kv``: what its prefix cache still has). Release held KV you will not
        extend; unpinned held KV is also released when memory runs short. (``retain_kv`` /
        ``extends`` are deprecated names.)
        """
        options = _make_options(options, fields)
        self._check_alive()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        stream, item = self._admit(rid, prompt, sampling or SamplingParams(), options)
        with self._cond:
            self._check_alive()
            if rid in self._streams:
                raise InvalidRequestError(f"request id {rid!r} is already live")
            self._check_queued(rid, item)
            self._streams[rid] = stream
            self._new.append(item)
            self._cond.notify()
        return stream

    def _check_queued(self, rid: str, item: QueuedT) -> None:
        """Under ``_cond``: raise InvalidRequestError if ``item`` may not be queued now."""

    def abort(self, request_id: str) -> None:
        """Abort a live request; the loop applies it before its next step. Idempotent."""
        with self._cond:
            if request_id in self._streams and not self._closed:
                self._aborts.append(request_id)
                self._cond.notify()

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | None = None
    ) -> list[Generation]:
        """Run a batch of prompts to completion (blocking); results in prompt order."""
        one = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        batch = cast("Sequence[Prompt]", [prompts] if one else prompts)
        streams: list[RequestStream] = []
        try:
            for prompt in batch:
                streams.append(self.add_request(prompt, sampling))
            return [s.result() for s in streams]
        finally:
            for s in streams:
                if not s.finished:
                    self.abort(s.request_id)

    async def stream(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        options: RequestOptions | None = None,
        **fields: object,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's deltas; leaving early or being cancelled aborts it. Options as
        in ``add_request``."""
        stream = self.add_request(
            prompt, sampling, request_id=request_id, options=options, **fields
        )
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    async def complete(self, prompt: Prompt, sampling: SamplingParams | None = None) -> Generation:
        """Await one request to completion."""
        stream = self.add_request(prompt, sampling)
        try:
            async for _ in stream:
                pass
        finally:
            if not stream.finished:
                self.abort(stream.request_id)
        return stream.to_generation()

    # ---- state -------------------------------------------------------------------------------

    def get_num_live_requests(self) -> int:
        with self._cond:
            return len(self._streams)

    @property
    def is_dead(self) -> bool:
        """The loop crashed: every call raises EngineDeadError (a router routes around it)."""
        return self._dead is not None

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the {self._loop_name} loop crashed") from self._dead
        if self._closed:
            raise EngineClosedError("the engine is closed")

    # ---- the loop thread ---------------------------------------------------------------------

    def _run_steps(self) -> None:
        """The loop thread's body: step until closed or dead, then fail what is still live."""
        try:
            self._before_steps()
            while self._loop_once():
                pass
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the callers
            self._die(exc)
        else:
            self._on_close()
            self._fail_all(
                lambda: EngineClosedError("the engine was closed before the request finished")
            )
        finally:
            self._after_steps()

    def _loop_once(self) -> bool:
        with self._cond:
            while not (self._closed or self._new or self._aborts or self._has_work()):
                self._cond.wait()
            if self._closed:
                return False
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
        self._step(new, aborts)
        return True

    def _die(self, exc: BaseException) -> None:
        # The traceback's frames hold the loop's locals (this backend, its engine and model): it
        # is kept as text on the exception, so a caller still holding a failed stream or the
        # error does not keep a dead engine's memory alive.
        exc.add_note("".join(traceback.format_tb(exc.__traceback__)).rstrip())
        exc.__traceback__ = None
        with self._cond:
            self._dead = exc
        name = self._loop_name

        def error() -> EngineDeadError:  # one per stream: each is raised in its own frames
            dead = EngineDeadError(f"the {name} loop crashed: {exc!r}")
            dead.__cause__ = exc
            return dead

        self._fail_all(error)

    def _fail_all(self, error: Callable[[], BaseException]) -> None:
        with self._cond:
            streams, self._streams = self._streams, {}
            self._new.clear()
        for stream in streams.values():
            stream.fail(error())

    # ---- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the loop thread; live requests fail with EngineClosedError. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    @property
    def closed(self) -> bool:
        return self._closed


def _make_options(options: RequestOptions | None, fields: dict[str, object]) -> RequestOptions:
    """``options`` with the keyword fields applied (unknown names raise TypeError)."""
    fields = dict(fields)
    if "retain_kv" in fields:
        warn_renamed("add_request(retain_kv=...)", "add_request(hold_kv=...)", stacklevel=4)
        fields["hold_kv"] = bool(fields.pop("retain_kv"))
    if "extends" in fields:
        warn_renamed("add_request(extends=...)", "add_request(held_kv=...)", stacklevel=4)
        fields["held_kv"] = fields.pop("extends")
    options = options or RequestOptions()
    return replace(options, **fields) if fields else options
