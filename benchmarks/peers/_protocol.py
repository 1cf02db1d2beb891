"""The worker side of the peer protocol, shared by every ``worker_<peer>.py`` (stdlib only).

The benchmark driver launches a worker as a subprocess and talks JSON lines:

    driver -> worker (stdin)   {"op": "generate", "id", "session", "prompt": [int], "max_tokens",
                                "return_ids"?: bool}   {"op": "end_session", "session"}
                               {"op": "shutdown"}
    worker -> driver (stdout)  {"ev": "ready", "engine", "version", "config"}  once, model loaded
                               {"ev": "tokens", "id", "n"}  new output tokens since the last event
                               {"ev": "done", "id", "num_output", "num_cached", "token_ids"?}
                               {"ev": "error", "id": str | None, "message"}

Owns the stdout discipline: :class:`Channel` moves fd 1 onto stderr (so prints of the engine
library, C code included, land in the log) and keeps a private duplicate for protocol lines.
Knows nothing about any engine.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import traceback
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Generate:
    id: str
    session: str
    prompt: list[int]
    max_tokens: int
    return_ids: bool = False


@dataclass(frozen=True, slots=True)
class EndSession:
    session: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Op = Generate | EndSession | Shutdown


class Channel:
    """Protocol lines to the driver; safe to call from any thread."""

    def __init__(self) -> None:
        sys.stdout.flush()
        private_fd = os.dup(1)
        os.dup2(2, 1)  # everything else written to fd 1 (C libraries too) goes to stderr
        sys.stdout = sys.stderr
        self._out = os.fdopen(private_fd, "w", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def send(self, event: dict) -> None:
        line = json.dumps(event, separators=(",", ":"))
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()

    def ready(self, engine: str, version: str, config: dict) -> None:
        self.send({"ev": "ready", "engine": engine, "version": version, "config": config})

    def tokens(self, request_id: str, n: int) -> None:
        self.send({"ev": "tokens", "id": request_id, "n": n})

    def done(
        self,
        request_id: str,
        num_output: int,
        num_cached: int | None,
        token_ids: list[int] | None = None,
    ) -> None:
        event = {"ev": "done", "id": request_id, "num_output": num_output, "num_cached": num_cached}
        if token_ids is not None:
            event["token_ids"] = token_ids
        self.send(event)

    def error(self, request_id: str | None, message: str) -> None:
        self.send({"ev": "error", "id": request_id, "message": message})


def parse_op(line: str) -> Op:
    """One stdin line -> an op. Raises ValueError with a message fit for an error event."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    op = obj.get("op")
    if op == "generate":
        prompt, max_tokens = obj.get("prompt"), obj.get("max_tokens")
        if not isinstance(obj.get("id"), str) or not isinstance(obj.get("session"), str):
            raise ValueError("generate needs string 'id' and 'session'")
        if not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
            raise ValueError("generate needs a non-empty 'prompt' of token ids")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError("generate needs 'max_tokens' >= 1")
        return Generate(obj["id"], obj["session"], prompt, max_tokens, bool(obj.get("return_ids")))
    if op == "end_session":
        if not isinstance(obj.get("session"), str):
            raise ValueError("end_session needs a string 'session'")
        return EndSession(obj["session"])
    if op == "shutdown":
        return Shutdown()
    raise ValueError(f"unknown op {op!r}")


def read_ops(channel: Channel, stream=None) -> Iterator[Op]:
    """Ops from stdin until shutdown or EOF (EOF reads as shutdown); a bad line becomes an
    error event and is skipped."""
    for line in stream or sys.stdin:
        if not line.strip():
            continue
        try:
            op = parse_op(line)
        except ValueError as exc:
            request_id = _maybe_id(line)
            channel.error(request_id, str(exc))
            continue
        yield op
        if isinstance(op, Shutdown):
            return
    yield Shutdown()


def _maybe_id(line: str) -> str | None:
    try:
        value = json.loads(line).get("id")
    except (json.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def common_prefix_size(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix; compares 4K-token slices at C speed first."""
    n, i, step = min(len(a), len(b)), 0, 4096
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Stopped(Exception):
    """Raised by a generation that saw ``shutdown`` before it finished."""


class SerialWorker(ABC):
    """A worker that runs one generation at a time, in arrival order.

    A reader thread keeps taking stdin lines while a generation runs; ops queue behind it.
    ``shutdown`` sets ``stopping``: the generation in flight calls ``check_stopping`` at each
    token and ends with an error event instead of a short ``done``.
    """

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.stopping = threading.Event()

    def check_stopping(self) -> None:
        if self.stopping.is_set():
            raise Stopped

    @abstractmethod
    def generate(self, op: Generate) -> None:
        """Run ``op`` to the end, sending tokens and done events; raise on failure."""

    @abstractmethod
    def end_session(self, session: str) -> None:
        """Forget what is kept for ``session``; unknown sessions are ignored."""

    def serve(self) -> None:
        ops: queue.Queue[Op] = queue.Queue()

        def read() -> None:
            for op in read_ops(self.channel):
                if isinstance(op, Shutdown):
                    self.stopping.set()
                ops.put(op)

        threading.Thread(target=read, name="stdin-reader", daemon=True).start()
        while True:
            op = ops.get()
            if isinstance(op, Shutdown) or self.stopping.is_set():
                return
            if isinstance(op, EndSession):
                self.end_session(op.session)
                continue
            try:
                self.generate(op)
            except Stopped:
                self.channel.error(op.id, "the worker shut down before this request finished")
                return
            except Exception as exc:  # one failed request must not take the worker down
                log(traceback.format_exc())
                self.channel.error(op.id, f"{type(exc).__name__}: {exc}")


def base_parser(description: str, omp_wait: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True, help="model path (see the worker's docstring)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--omp-wait",
        type=str.lower,
        choices=["spin", "passive", "active"],
        default=omp_wait,
        help=f"how idle OpenMP threads wait (default {omp_wait}; see README)",
    )
    parser.add_argument("--omp-spincount", type=int, default=10_000, help="for --omp-wait spin")
    return parser


def set_thread_env(args: argparse.Namespace) -> None:
    """OpenMP settings, before the engine library (and its libgomp) is imported.

    libgomp lets an idle worker spin up to ~300K iterations (forever with ``active``) before it
    sleeps. Spinning threads collapse when the machine has fewer free cores than threads: on the
    shared 2-core box, decode ran 10x slower with 2 spinning threads than with 1. ``passive``
    sleeps at once, which fixes that but pays a futex wake-up per parallel region (small decode
    steps suffer). ``spin`` (default) spins ``--omp-spincount`` iterations, a few microseconds,
    then sleeps. Which is best depends on the engine (measured back to back, README): ``spin``
    for vLLM, ``passive`` for transformers and llama.cpp (with ``spin`` llama.cpp decode ran 6x
    slower: its own barriers inside each OpenMP region spin on top).
    """
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.omp_wait == "spin":
        os.environ.pop("OMP_WAIT_POLICY", None)
        os.environ["GOMP_SPINCOUNT"] = str(args.omp_spincount)
    else:
        os.environ.pop("GOMP_SPINCOUNT", None)
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait.upper()


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)
