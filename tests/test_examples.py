"""The examples run to completion on the default model (they are what `make demo` shows)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# the scripts import this checkout's agentx, not an installed one
PYTHONPATH = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


@pytest.mark.parametrize(
    "script, expected",
    [
        ("quickstart.py", ["-> tool call add(", "forked 2 subagents", "total usage"]),
        ("coding_agent.py", ["-> grep(", "agentx/engine/scheduler/scheduler.py"]),
        ("eval_fanout.py", ["subagents forked from", "score:"]),
        ("pydantic_ai_agent.py", ["-> tool call add(17, 25)", "answer:", "cached"]),
        ("openai_agents_sdk.py", ["-> tool call add(17, 25)", "answer:", "cached"]),
        ("kv_policy.py", ["kv_policy_errors=0", "soft-pinned the system prompt: 8"]),
    ],
)
def test_example_runs(script, expected):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for line in expected:
        assert line in proc.stdout, f"{line!r} missing from {script} output"
