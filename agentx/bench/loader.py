"""Load a trace file in whichever supported format it is written."""

from __future__ import annotations

import json
from pathlib import Path

from agentx.bench.format_agentx import load_agentx
from agentx.bench.format_mooncake import load_mooncake
from agentx.bench.trace import Trace


def load_trace(path: str | Path) -> Trace:
    """A ``.jsonl`` whose first record has ``input_length`` is Mooncake; anything else
    (``.json``, ``.jsonl`` of sessions) is the AgentX format. Raises TraceError."""
    path = Path(path)
    if path.suffix == ".jsonl" and _first_record_is_mooncake(path):
        return load_mooncake(path)
    return load_agentx(path)


def _first_record_is_mooncake(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    obj = json.loads(line)
                    return isinstance(obj, dict) and "input_length" in obj
    except (OSError, ValueError, RecursionError):  # ValueError: JSON and UTF-8 errors
        return False  # the AgentX loader reports the problem with its location
    return False
