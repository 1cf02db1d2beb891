"""EngineInstance: the coordinator's handle on one P/D instance process (worker.py).

    call(method, *args)  -> sends InstanceCall, waits for its InstanceReply (or the death)
    add_request(..., sink) -> every delta of the request goes to ``sink`` on the reader thread,
                              then one end: a finished delta or an exception

One reader thread per instance drains its pipe and watches its process: when the process dies
(killed, crashed, closed) every call waiting on it raises :class:`InstanceDeadError` and every
request it ran ends in its sink with one, at once; no caller waits on a dead process. Sinks run
on the reader thread: they must not call back into the same instance (the reply would arrive
on the thread they hold).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import wait
from typing import Any

from agentx.config import EngineConfig
from agentx.engine.disagg.worker import (
    CLOSE,
    InstanceCall,
    InstanceFailure,
    InstanceOutput,
    InstanceReady,
    InstanceReply,
    run_instance,
)
from agentx.engine.outputs import RequestOutput
from agentx.engine.parallel.bootstrap import unguarded_main_error
from agentx.engine.request import RequestOptions
from agentx.engine.sampling import SamplingParams
from agentx.errors import EngineClosedError, InstanceDeadError

Sink = Callable[[RequestOutput | BaseException], None]

logger = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 10.0


class EngineInstance:
    """Spawns the process; ``wait_started`` waits for its engine, then the reader runs."""

    def __init__(self, name: str, config: EngineConfig, context) -> None:
        self.name = name
        ours, theirs = context.Pipe()
        self.process = context.Process(
            target=run_instance, args=(config, theirs), name=f"agentx-{name}", daemon=True
        )
        self.process.start()
        theirs.close()
        self._conn = ours
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, Future] = {}
        self._sinks: dict[str, Sink] = {}
        self._dead: InstanceDeadError | None = None
        self._closing = False
        self.block_size = 0
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self._dead is None and not self._closing

    def get_num_live_requests(self) -> int:
        with self._lock:
            return len(self._sinks)

    def wait_started(self) -> None:
        """Block until the engine is built; InstanceDeadError if the process failed first."""
        ready = wait([self._conn, self.process.sentinel])
        message = None
        if self._conn in ready:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                pass  # it died before a word
        if not isinstance(message, InstanceReady):
            self.process.join(_CLOSE_TIMEOUT_S)
            detail = message.error if isinstance(message, InstanceFailure) else "no word"
            unguarded = unguarded_main_error(self.process.exitcode, self.name)
            if unguarded is not None:
                raise InstanceDeadError(str(unguarded), self.name)
            raise InstanceDeadError(
                f"{self.name} (pid {self.pid}) failed to start, exit {self.process.exitcode}:"
                f"\n{detail}",
                self.name,
            )
        self.block_size = message.block_size
        self._reader = threading.Thread(target=self._read, name=f"{self.name}-reader", daemon=True)
        self._reader.start()

    # ---- calls ---------------------------------------------------------------------------

    def call(self, method: str, *args: Any) -> Any:
        """Run ``method`` in the instance and return its answer; raises what it raised there,
        or InstanceDeadError when the process dies first."""
        future: Future = Future()
        with self._lock:
            if self._dead is not None:
                raise InstanceDeadError(str(self._dead), self.name)
            if self._closing and method != CLOSE:
                raise EngineClosedError(f"{self.name} is closed")
            call_id = next(self._ids)
            self._pending[call_id] = future
            try:
                self._conn.send(InstanceCall(call_id, method, args))
            except (OSError, EOFError):
                pass  # a dead process: the reader fails the future
        return future.result()

    def add_request(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        request_id: str,
        options: RequestOptions,
        sink: Sink,
    ) -> None:
        """Queue a request; its deltas and its end go to ``sink`` (reader thread)."""
        with self._lock:
            self._sinks[request_id] = sink
        try:
            self.call("add_request", prompt, sampling, request_id, options)
        except BaseException:
            with self._lock:
                self._sinks.pop(request_id, None)
            raise

    # ---- the reader thread ---------------------------------------------------------------

    def _read(self) -> None:
        while True:
            ready = wait([self._conn, self.process.sentinel])
            if self._conn not in ready:
                break  # the process is gone and its pipe holds nothing more
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            self._handle(message)
        self._die()

    def _handle(self, message: object) -> None:
        if isinstance(message, InstanceReply):
            with self._lock:
                future = self._pending.pop(message.call_id, None)
            if future is None:
                return
            if message.error is not None:
                future.set_exception(message.error)
            else:
                future.set_result(message.result)
            return
        assert isinstance(message, InstanceOutput), message
        out = message.output
        ended = out is None or out.finished
        with self._lock:
            sink = (self._sinks.pop if ended else self._sinks.get)(message.request_id, None)
        if sink is not None:
            _deliver(sink, out if out is not None else message.error)

    def _die(self) -> None:
        self.process.join(_CLOSE_TIMEOUT_S)  # its sentinel fired: reapable now
        code = self.process.exitcode
        with self._lock:
            closing = self._closing
            reason = f"{self.name} (pid {self.pid}) died, exit {code}"
            self._dead = InstanceDeadError(reason, self.name)
            pending, self._pending = self._pending, {}
            sinks, self._sinks = self._sinks, {}
        for future in pending.values():
            future.set_exception(InstanceDeadError(reason, self.name))
        for sink in sinks.values():
            if closing:
                _deliver(sink, EngineClosedError(f"{self.name} was closed"))
            else:
                _deliver(sink, InstanceDeadError(reason, self.name))

    # ---- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Ask the process to exit, kill it if it does not in time, reap it. Idempotent."""
        with self._lock:
            was_closing, self._closing = self._closing, True
        if was_closing:
            return
        if self._reader is None:  # never started: nothing to ask
            self.process.kill()
        elif self._dead is None:
            closer = threading.Thread(target=self._ask_to_close, daemon=True)
            closer.start()
            closer.join(_CLOSE_TIMEOUT_S)
        self.process.join(_CLOSE_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        if self._reader is not None:
            self._reader.join()
        self._conn.close()

    def _ask_to_close(self) -> None:
        try:
            self.call(CLOSE)
        except Exception:  # noqa: BLE001 - dead already: nothing to ask
            pass


def _deliver(sink: Sink, item: RequestOutput | BaseException) -> None:
    try:
        sink(item)
    except Exception:  # noqa: BLE001 - a sink's bug must not stop the reader
        logger.exception("a P/D sink raised")
