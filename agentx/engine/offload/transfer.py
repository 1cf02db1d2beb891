"""The transfer worker: one thread beside the engine loop that runs offload jobs in FIFO order.

The engine thread plans a job (the ``prepare_*`` half of every tier call, cheap bookkeeping) and
submits it; the worker moves the bytes and ends the job (the ``complete_*`` half); the engine
drains what finished with ``take_events()``. ``submit`` never blocks. FIFO order matters: the
tiered store relies on it (a slot is demoted before it is overwritten, a file is unlinked
before the same hash is written again).

A job that raises midway is not lost: its ``fail`` hook ends every tier operation it left open
and the event reports the hashes as failed, so the engine recomputes them.
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

from agentx.engine.block_hash import BlockHash

__all__ = ["TransferEvent", "TransferJob", "TransferWorker"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TransferEvent:
    """A finished job: the hashes it stored or loaded (``done``) and those it could not.

    For a load, ``done`` is a prefix of the requested hashes (the first failure fails the rest:
    the engine can only use a contiguous prefix). For a store, ``done`` holds the hashes held by
    at least one target tier afterwards (written now or already there), ``failed`` those whose
    writes all failed, ``skipped`` those no target tier attempted (no room: everything in
    flight; tier unhealthy; another job already writing them). The job's pages are free again.
    """

    job_id: int
    kind: Literal["store", "load"]
    done: tuple[BlockHash, ...]
    failed: tuple[BlockHash, ...]
    skipped: tuple[BlockHash, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failed


class TransferJob(ABC):
    """A unit of work for the worker; built and prepared on the engine thread."""

    job_id: int
    kind: Literal["store", "load"]
    hashes: tuple[BlockHash, ...]  # what the job covers (reported failed if all else fails)

    @abstractmethod
    def run(self) -> TransferEvent:
        """Move the bytes and complete every prepared tier operation. Worker thread."""

    @abstractmethod
    def fail(self, exc: BaseException) -> TransferEvent:
        """``run`` raised: complete what it left open as failed; report all as failed."""


class TransferWorker:
    """A daemon thread with a job queue and an event list."""

    def __init__(self, name: str = "agentx-offload") -> None:
        self._queue: queue.SimpleQueue[TransferJob | None] = queue.SimpleQueue()
        self._events: list[TransferEvent] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._num_pending = 0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        """Jobs submitted whose events are not yet produced."""
        with self._lock:
            return self._num_pending

    def submit(self, job: TransferJob) -> None:
        """Queue a job; returns at once. Raises RuntimeError after ``close``."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the transfer worker is closed")
            self._num_pending += 1
        self._queue.put(job)

    def take_events(self) -> list[TransferEvent]:
        """Drain the finished jobs' events, in completion (= submission) order."""
        with self._lock:
            out, self._events = self._events, []
        return out

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted job has its event (tests, shutdown). True if idle."""
        with self._idle:
            return self._idle.wait_for(lambda: self._num_pending == 0, timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Finish the queued jobs, then stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                event = job.run()
            except BaseException as exc:  # noqa: BLE001  (any failure is a failed transfer)
                logger.warning("offload job %d failed: %r", job.job_id, exc)
                try:
                    event = job.fail(exc)
                except BaseException:  # noqa: BLE001  (the worker must outlive any job)
                    logger.exception("offload job %d: cleanup failed", job.job_id)
                    event = TransferEvent(job.job_id, job.kind, (), tuple(job.hashes))
            with self._idle:
                self._events.append(event)
                self._num_pending -= 1
                self._idle.notify_all()
