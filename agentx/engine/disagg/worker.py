"""One P/D instance's process: a whole Engine served over a pipe.

    coordinator (instance.py)                       this process
        InstanceCall(call_id, method, args) --pipe-->   ServedEngine.<method>(*args)
                   InstanceReply(call_id, ...)  <--     (the answer, or the error it raised)
                   InstanceOutput(request_id, ...) <--  every delta of every request, in order

Calls are served one at a time on the main thread; each request's deltas are forwarded by a
thread of its own (the Engine's streams block), so a long decode never delays a call. A request's
deltas are sent after the reply to the call that added it. The process exits when told to
close, when its pipe closes (the coordinator is gone: it never outlives it), or when its
engine's loop crashes (the coordinator then sees a dead instance, as if it had been killed).
"""

from __future__ import annotations

import os
import pickle
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from agentx.config import EngineConfig
from agentx.engine.client import Engine
from agentx.engine.offload.interface import KVExport
from agentx.engine.outputs import EngineStats, RequestOutput
from agentx.engine.request import RequestOptions
from agentx.engine.sampling import SamplingParams
from agentx.engine.streams import RequestStream
from agentx.errors import AgentXError, EngineDeadError


@dataclass(frozen=True, slots=True)
class InstanceCall:
    call_id: int
    method: str
    args: tuple = ()


@dataclass(frozen=True, slots=True)
class InstanceReply:
    call_id: int
    result: Any = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class InstanceOutput:
    """A delta of a request, or (``output`` None) the error that ended its stream."""

    request_id: str
    output: RequestOutput | None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class InstanceReady:
    pid: int
    block_size: int


@dataclass(frozen=True, slots=True)
class InstanceFailure:
    error: str  # repr and traceback of what start-up raised


CLOSE = "close"
_EXIT_ENGINE_DEAD = 70


def run_instance(config: EngineConfig, conn: Connection) -> None:
    """The instance process's entry point (spawned by ``EngineInstance``)."""
    try:
        engine = Engine(config)
        engine.wait_ready()
        conn.send(InstanceReady(os.getpid(), engine.capabilities().block_size))
    except BaseException:  # noqa: BLE001 - reported to the coordinator, which raises it
        conn.send(InstanceFailure(traceback.format_exc()))
        return
    try:
        ServedEngine(engine, conn).serve()
    finally:
        engine.close()


class ServedEngine:
    """The calls an instance serves: the Engine's, with what crosses the pipe picklable."""

    def __init__(self, engine: Engine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self._send_lock = threading.Lock()  # the main thread and the forwarders share the pipe
        self._streams: dict[str, RequestStream] = {}  # added, not yet forwarded

    def serve(self) -> None:
        while True:
            try:
                call: InstanceCall = self.conn.recv()
            except (EOFError, OSError):
                return  # the coordinator is gone
            if call.method == CLOSE:
                self._send(InstanceReply(call.call_id))
                return
            try:
                result = getattr(self, call.method)(*call.args)
            except Exception as exc:  # noqa: BLE001 - the caller raises it
                result = None
                self._send(InstanceReply(call.call_id, error=_picklable(exc)))
            else:
                self._send(InstanceReply(call.call_id, result))
            if call.method == "add_request":
                self._start_forwarding(result)

    def _send(self, message: object) -> None:
        with self._send_lock:
            try:
                self.conn.send(message)
            except (OSError, EOFError):
                pass  # the coordinator is gone; serve() sees the closed pipe next

    # ---- calls ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        request_id: str,
        options: RequestOptions,
    ) -> str:
        stream = self.engine.add_request(prompt, sampling, request_id=request_id, options=options)
        self._streams[request_id] = stream
        return request_id

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    def describe(self) -> tuple[str, int, int]:
        """The tokenizer (``Tokenizer.to_cache_json``), ``max_model_len`` and block size: what
        the coordinator needs to stand in for an engine."""
        engine = self.engine
        return engine.tokenizer.to_cache_json(), engine.max_model_len, engine.core.kv.block_size

    def export_held(self, handle: str, include_tail: bool) -> KVExport | None:
        return self.engine.export_held(handle, include_tail)

    def import_held(self, export: KVExport, handle: str | None) -> str | None:
        return self.engine.import_held(export, handle)

    def release_held(self, handle: str) -> bool:
        return self.engine.release_held(handle)

    def flush_offload(self) -> None:
        self.engine.flush_offload()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    # ---- deltas --------------------------------------------------------------------------

    def _start_forwarding(self, request_id: str | None) -> None:
        stream = self._streams.pop(request_id, None) if request_id is not None else None
        if stream is not None:
            threading.Thread(
                target=self._forward, args=(stream,), name=f"forward-{request_id}", daemon=True
            ).start()

    def _forward(self, stream: RequestStream) -> None:
        try:
            while True:
                out = stream.get()
                self._send(InstanceOutput(stream.request_id, out))
                if out.finished:
                    return
        except BaseException as exc:  # noqa: BLE001 - the stream's end, sent as it is
            self._send(InstanceOutput(stream.request_id, None, _picklable(exc)))
            if isinstance(exc, EngineDeadError):
                # the engine loop crashed: this instance serves nothing any more, and its
                # exit is what tells the coordinator (its other requests fail as it sees it)
                os._exit(_EXIT_ENGINE_DEAD)


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` if it crosses a pipe as it is, else an AgentXError carrying its repr."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - anything unpicklable is sent as text
        return AgentXError(f"{exc!r}\n{''.join(traceback.format_exception(exc))}")
    return exc
