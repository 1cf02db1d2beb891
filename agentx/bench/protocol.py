"""The worker protocol: how the benchmark driver talks to an engine in a subprocess.

Every engine (agentx, vLLM, llama.cpp, transformers) runs as a worker launched as::

    <python> <worker> --model PATH --threads N [engine-specific flags]

Driver -> worker, on stdin, one JSON object per line::

    {"op": "generate", "id": str, "session": str, "prompt": [int, ...], "max_tokens": int,
     "return_ids"?: bool}
    {"op": "end_session", "session": str}
    {"op": "stats"}                              ask for the engine's own counters (agentx's
                                                 worker; sent only to workers whose "ready"
                                                 named engine "agentx")
    {"op": "shutdown"}

Worker -> driver, on stdout, one JSON object per line (logs go to stderr)::

    {"ev": "ready", "engine": str, "version": str, "config": {...}}   once, after the model loaded
    {"ev": "tokens", "id": str, "n": int}        n new output tokens since the last event for
                                                 this id, sent as soon as they are produced
    {"ev": "done", "id": str, "num_output": int, "num_cached": int | null,
     "token_ids"?: [int, ...]}                   num_cached: prompt tokens reused from the
                                                 engine's cache, when known; token_ids: the
                                                 output, when the op had "return_ids"
    {"ev": "error", "id": str | null, "message": str}
    {"ev": "stats", "stats": {...} | null}       the answer to "stats"

Prompts travel as token ids: the driver's adapter tokenizes text prompts with the tokenizer of
the worker's model (:mod:`agentx.bench.worker_adapter`). Generation is greedy, ignores EOS and
produces exactly ``max_tokens`` output tokens. A worker accepts new ``generate`` lines while
others run (it may process them serially). The driver timestamps events on receipt
(``time.perf_counter``). After ``shutdown`` the worker exits.

This module only encodes and decodes the lines; it holds no state.
"""

from __future__ import annotations

import json
from typing import Any


class ProtocolError(RuntimeError):
    """A line that does not follow the protocol."""


def encode(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def generate_op(
    request_id: str, session: str, prompt: list[int], max_tokens: int, return_ids: bool = False
) -> bytes:
    op = {
        "op": "generate",
        "id": request_id,
        "session": session,
        "prompt": prompt,
        "max_tokens": max_tokens,
    }
    if return_ids:
        op["return_ids"] = True
    return encode(op)


def end_session_op(session: str) -> bytes:
    return encode({"op": "end_session", "session": session})


def shutdown_op() -> bytes:
    return encode({"op": "shutdown"})


def stats_op() -> bytes:
    return encode({"op": "stats"})


def stats_ev(stats: dict | None) -> bytes:
    return encode({"ev": "stats", "stats": stats})


def ready_ev(engine: str, version: str, config: dict) -> bytes:
    return encode({"ev": "ready", "engine": engine, "version": version, "config": config})


def tokens_ev(request_id: str, n: int) -> bytes:
    return encode({"ev": "tokens", "id": request_id, "n": n})


def done_ev(
    request_id: str,
    num_output: int,
    num_cached: int | None,
    token_ids: tuple[int, ...] | list[int] | None = None,
) -> bytes:
    ev = {"ev": "done", "id": request_id, "num_output": num_output, "num_cached": num_cached}
    if token_ids is not None:
        ev["token_ids"] = list(token_ids)
    return encode(ev)


def error_ev(request_id: str | None, message: str) -> bytes:
    return encode({"ev": "error", "id": request_id, "message": message})


_REQUIRED = {
    "ready": ("engine", "version", "config"),
    "tokens": ("id", "n"),
    "done": ("id", "num_output", "num_cached"),
    "error": ("id", "message"),
    "stats": (),
    "generate": ("id", "session", "prompt", "max_tokens"),
    "end_session": ("session",),
    "shutdown": (),
}


def decode(line: bytes | str, key: str) -> dict[str, Any]:
    """Parse one line; ``key`` is "ev" (worker output) or "op" (driver input)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"not JSON: {line[:200]!r}") from exc
    if not isinstance(obj, dict) or obj.get(key) not in _REQUIRED:
        raise ProtocolError(f"unknown {key}: {str(line)[:200]}")
    missing = [f for f in _REQUIRED[obj[key]] if f not in obj]
    if missing:
        raise ProtocolError(f"{obj[key]!r} line lacks {missing}: {str(line)[:200]}")
    return obj
