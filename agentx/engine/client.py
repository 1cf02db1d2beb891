"""Engine: the in-process engine a program talks to.

It owns a background loop thread that drives ``EngineCore.step()``. Callers on any thread add
requests (validated at once, on the caller's thread) and read their deltas from a
:class:`RequestStream`; the loop thread picks additions and aborts up between steps. If the
loop raises, every live request fails with :class:`EngineDeadError`; ``close()`` stops the thread
and fails what is still live with :class:`EngineClosedError`.

Start-up work that requests would otherwise pay for on first use runs in the background, so
``Engine()`` returns as soon as the model is loaded and the first request costs what any later
cold request costs: the loop thread runs one small warm-up forward before its first step, and a
second thread builds the grammar tokenizer tables and compiles the chat template.
``wait_ready()`` waits for both; requests may be added at any time before that.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable

from agentx.config import EngineConfig
from agentx.engine.backend import EngineCapabilities, Prompt
from agentx.engine.core import EngineCore
from agentx.engine.loop_backend import LoopBackend
from agentx.engine.offload.interface import KVExport
from agentx.engine.outputs import EngineStats, RequestOutput
from agentx.engine.request import Request, RequestOptions
from agentx.engine.sampling import SamplingParams
from agentx.engine.scheduler import StepClock
from agentx.engine.streams import RequestStream
from agentx.errors import InvalidRequestError, RequestAbortedError, warn_renamed

__all__ = ["Engine", "Prompt"]

_Queued = tuple[Request, RequestStream]  # a request and its stream, queued for the loop
_Control = Callable[[EngineCore], object]  # a release or pin, run by the loop before a step

logger = logging.getLogger(__name__)


class Engine(LoopBackend[_Queued]):
    """agentx's own engine: the embedded default backend of every Session."""

    def __init__(
        self, config: EngineConfig | None = None, *, step_clock: StepClock | None = None
    ) -> None:
        """``step_clock``: a step index shared with the other replicas of a ReplicaRouter
        (their ``prefill_schedule_interval`` windows align); None: this engine's own."""
        super().__init__()
        self.config = config or EngineConfig()
        self.core = EngineCore(self.config, step_clock)
        self.core.wait_when_idle = False  # the loop waits outside its step lock (_loop_once)
        self.tokenizer = self.core.tokenizer
        self.max_model_len = self.core.max_model_len
        self._controls: list[_Control] = []  # run by the loop, in order
        self._orphans: deque[str] = deque()  # held KV to release, queued without a lock
        self._num_applying = 0  # controls the loop took and has not applied yet (under _cond)
        self._warmed_up = threading.Event()  # set when the loop's warm-up ended (or failed)
        self._preparer = threading.Thread(target=self._prepare, name="agentx-prepare", daemon=True)
        self._preparer.start()
        self._thread = threading.Thread(target=self._run_steps, name="agentx-engine", daemon=True)
        self._thread.start()

    # ---- requests ----------------------------------------------------------------------------

    def _admit(
        self, rid: str, prompt: Prompt, sampling: SamplingParams, options: RequestOptions
    ) -> tuple[RequestStream, _Queued]:
        request = self.core.make_request(rid, prompt, sampling, options=options)
        stream = RequestStream.for_sampling(rid, request.prompt_token_ids, request.sampling)
        return stream, (request, stream)

    def _check_queued(self, rid: str, item: _Queued) -> None:
        if rid in self.core.kv.held and item[0].held_kv != rid:
            # holding again under it would silently drop the KV the handle names
            raise InvalidRequestError(
                f"request id {rid!r} names held KV: continue from it (held_kv={rid!r}), "
                "release it first, or use another id"
            )

    def tokenize(self, prompt: Prompt) -> list[int]:
        """The token ids a request of ``prompt`` holds (InvalidRequestError as add_request)."""
        return self.core.tokenize(prompt)

    # ---- held KV (a finished turn's KV, held for the next turn: kv_cache/held.py) -----------

    def fork_held(self, handle: str, num_forks: int) -> list[str]:
        """Fork held KV into ``num_forks`` new handles (copy-on-write of the partial tail
        block). Returns [] if the handle is gone or the pool has no room."""
        self._check_alive()
        new_handles = [f"{handle}/fork-{next(self._ids)}" for _ in range(num_forks)]
        with self._step_lock:
            return new_handles if self.core.fork_held(handle, new_handles) else []

    def export_held(self, handle: str, include_tail: bool = False) -> KVExport | None:
        """Name held KV's prefix in the shared offload tiers (waits for its stores), for
        ``import_held`` on another engine with the same model; None without offload.
        ``include_tail``: the partial last block (and a hybrid's linear states) goes too,
        so the importer resumes at the exact token this engine stopped at (a P/D hand-over);
        else full blocks only."""
        self._check_alive()
        with self._step_lock:
            return self.core.export_held(handle, include_tail)

    def import_held(self, export: KVExport, handle: str | None = None) -> str | None:
        """Load an exported prefix from the shared tiers as held KV; returns its handle (pass
        it as ``held_kv``), or None when nothing could be loaded."""
        self._check_alive()
        handle = handle or f"import-{uuid.uuid4().hex[:12]}"
        with self._step_lock:
            return handle if self.core.import_held(export, handle) else None

    def flush_offload(self, timeout: float = 30.0) -> None:
        """Wait until the KV this engine has queued for its offload tiers has landed there
        (another engine sharing a tier then finds it); nothing without offload."""
        self._check_alive()
        with self._step_lock:
            self.core.flush_offload(timeout)

    def release_held(self, handle: str, drop_cached: bool = False) -> bool:
        """Release held KV; ``drop_cached`` also forgets its blocks' cached content."""
        with self._step_lock:
            return self.core.release_held(handle, drop_cached)

    def release_held_soon(self, handle: str, drop_cached: bool = False) -> None:
        """Like ``release_held``, without waiting: the loop releases it before its next step."""
        self._control(lambda core: core.release_held(handle, drop_cached))

    def release_held_eventually(self, handle: str) -> None:
        """Like ``release_held_soon``, but it never blocks: a garbage collector's finalizer
        calls it, on whatever thread collected (maybe one holding a stream's lock). The loop
        releases it when it next wakes (at once unless the loop held its lock just then)."""
        if self._closed:
            return
        self._orphans.append(handle)
        if self._cond.acquire(blocking=False):
            try:
                self._cond.notify()
            finally:
                self._cond.release()

    def pin_held(self, handle: str, pinned: bool = True) -> bool:
        """Pinned held KV is never released to make room."""
        with self._step_lock:
            return self.core.pin_held(handle, pinned)

    def pin_held_soon(self, handle: str, pinned: bool = True) -> None:
        """Like ``pin_held``, without waiting: the loop applies it before its next step."""
        self._control(lambda core: core.pin_held(handle, pinned))

    def has_pending_controls(self) -> bool:
        """Whether a release, pin or other control queued so far is still unapplied. When it
        is False, every control queued before the call has taken effect: a ``stats()`` taken
        after it shows them (the loop takes queued controls off the queue before its step
        lock, so an empty queue alone does not say they were applied)."""
        with self._cond:
            return bool(self._controls or self._orphans or self._num_applying)

    def _control(self, op: _Control) -> None:
        with self._cond:
            if not self._closed:
                self._controls.append(op)
                self._cond.notify()

    # deprecated names of the held-KV methods (they warn, then do the same)

    def fork_kv(self, handle: str, num_forks: int) -> list[str]:
        warn_renamed("Engine.fork_kv", "Engine.fork_held")
        return self.fork_held(handle, num_forks)

    def export_kv(self, handle: str) -> KVExport | None:
        warn_renamed("Engine.export_kv", "Engine.export_held")
        return self.export_held(handle)

    def import_kv(self, export: KVExport, handle: str | None = None) -> str | None:
        warn_renamed("Engine.import_kv", "Engine.import_held")
        return self.import_held(export, handle)

    def release_kv(self, handle: str, drop_cached: bool = False) -> bool:
        warn_renamed("Engine.release_kv", "Engine.release_held")
        return self.release_held(handle, drop_cached)

    def release_kv_soon(self, handle: str, drop_cached: bool = False) -> None:
        warn_renamed("Engine.release_kv_soon", "Engine.release_held_soon")
        self.release_held_soon(handle, drop_cached)

    def pin_kv(self, handle: str, pinned: bool = True) -> bool:
        warn_renamed("Engine.pin_kv", "Engine.pin_held")
        return self.pin_held(handle, pinned)

    def pin_kv_soon(self, handle: str, pinned: bool = True) -> None:
        warn_renamed("Engine.pin_kv_soon", "Engine.pin_held_soon")
        self.pin_held_soon(handle, pinned)

    # ---- state -------------------------------------------------------------------------------

    def capabilities(self) -> EngineCapabilities:
        """Everything in the interface is honoured; the offload-driven parts (tool latency,
        export) need ``config.offload`` and speculative drafting ``config.speculative``."""
        return EngineCapabilities(
            name="agentx",
            block_size=self.core.kv.block_size,
            tool_latency=self.config.offload.enabled,
            export_held=self.config.offload.enabled,
            draft_from_context=self.core._speculate,
            session_affinity=False,  # one replica per Engine (the router owns data parallel)
        )

    def stats(self) -> EngineStats:
        with self._step_lock:
            return self.core.get_stats()

    def check_integrity(self) -> None:
        with self._step_lock:
            self.core.check_integrity()

    # ---- the loop thread ---------------------------------------------------------------------

    def _before_steps(self) -> None:
        try:
            with self._step_lock:  # held sequences' calls touch the KV tensors too
                self.core.warm_up()
        finally:
            self._warmed_up.set()

    def _on_close(self) -> None:
        with self._step_lock:  # give every block back, so a closed engine leaks nothing
            self.core.abort_requests(list(self.core.scheduler.requests))

    def _after_steps(self) -> None:
        self.core.close()

    def _has_work(self) -> bool:
        return bool(self._controls or self._orphans) or self.core.has_unfinished_requests()

    def _take_controls(self) -> tuple[list[_Queued], list[str], list[_Control]]:
        """The requests, aborts and controls queued since the loop took its requests and aborts,
        in one snapshot: every control then applies after what its caller queued before it.
        A caller that aborts a request and releases its id (Session's `break`) would otherwise
        see the release applied (a no-op: the request still ran) a step before the abort, and
        the KV the request then held under its id stayed held (the dp2 soak caught it)."""
        with self._cond:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
            controls, self._controls = self._controls, []
            while self._orphans:
                handle = self._orphans.popleft()
                controls.append(lambda core, handle=handle: core.release_held(handle))
            self._num_applying = len(controls)
        return new, aborts, controls

    def _step(self, new: list[_Queued], aborts: list[str]) -> None:
        late_new, late_aborts, controls = self._take_controls()
        new, aborts = new + late_new, aborts + late_aborts
        try:
            with self._step_lock:
                for request, _ in new:
                    self.core.add_request(request)
                outputs = self.core.abort_requests(aborts)
                for op in controls:
                    op(self.core)
                outputs += self.core.step()
                idle = self.core.is_idle
        finally:
            if controls:
                with self._cond:
                    self._num_applying = 0
        self._dispatch(outputs)
        if idle:  # waiting on a transfer or a tool's return: never with the step lock held
            self.core.offload.idle_wait()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        with self._cond:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finish_reason == "abort":
                    del self._streams[out.request_id]
                    stream.fail(RequestAbortedError(f"request {out.request_id} was aborted"))
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                stream.put(out)

    # ---- lifecycle ---------------------------------------------------------------------------

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the start-up work (warm-up forward, grammar tables, chat template) is done;
        False if ``timeout`` seconds passed first. Never needed for correctness: a request sent
        earlier waits for what it needs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._preparer.join(timeout)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._warmed_up.wait(remaining) and not self._preparer.is_alive()

    def _prepare(self) -> None:
        try:
            self.core.prepare()
        except Exception:  # noqa: BLE001 - the request that needs it raises the error again
            logger.debug("start-up preparation failed; retried on first use", exc_info=True)

    def close(self) -> None:
        super().close()
        if threading.current_thread() is not self._thread:
            _return_freed_heap()


def _return_freed_heap() -> None:
    """Give the heap pages the closed engine's threads freed back to the OS (glibc keeps them
    in its per-thread arenas): without it a process that restarts engines, as a harness does
    after an EngineDeadError, grew ~150 MiB a restart in the soak. A no-op off glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):
            _malloc_trim = _no_trim
    _malloc_trim(0)


def _no_trim(pad: int) -> int:
    return 0


_malloc_trim: Callable[[int], int] | None = None
