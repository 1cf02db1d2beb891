"""The Mooncake (FAST'25) trace format: one request per JSONL line::

    {"timestamp": ms, "input_length": int, "output_length": int, "hash_ids": [int, ...]}

Block size 512 tokens; hash ids are global to the file. Every line becomes a one-request
session whose ``start_time`` is the recorded arrival (replay is closed-loop: concurrency, not
arrival times, paces it).
"""

from __future__ import annotations

import json
from pathlib import Path

from agentx.bench.fields import Where
from agentx.bench.trace import SessionTrace, Trace, TraceRequest
from agentx.errors import TraceError

MOONCAKE_BLOCK_SIZE = 512


def load_mooncake(path: str | Path, block_size: int = MOONCAKE_BLOCK_SIZE) -> Trace:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from exc
    sessions = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}: line {i}: invalid JSON: {exc}") from exc
        except RecursionError:
            raise TraceError(f"{path}: line {i}: invalid JSON: nested too deeply") from None
        where = Where.of(str(path), f"line {i}", obj)
        request = TraceRequest(
            t=0.0,
            num_input_tokens=where.get_int("input_length"),
            num_output_tokens=where.get_int("output_length"),
            hash_ids=where.get_ints("hash_ids"),
        )
        start = where.get_float("timestamp", 0.0) / 1000.0
        sessions.append(SessionTrace(f"r{len(sessions)}", (request,), "", start_time=start))
    if not sessions:
        raise TraceError(f"{path}: no requests in the file")
    return Trace(path.stem, block_size, tuple(sessions), "mooncake")
