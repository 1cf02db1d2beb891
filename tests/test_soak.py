"""The soak (benchmarks/soak.py) for 60 seconds: concurrent sessions under every fault, then
the fault-free replay and the leak checks. ``make test`` runs it inside a private network
namespace, so the Mooncake master restart is part of it there; elsewhere that phase idles.
The 30-minute run and its figures are in docs/BENCHMARKS.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentx import kernels

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_a_60_second_soak_loses_nothing(tmp_path):
    out = tmp_path / "soak.json"
    # 5 phases of 12 s: none, disk_corrupt, disk_full, mooncake_restart, step_crash
    command = [sys.executable, str(ROOT / "benchmarks/soak.py"), "--seconds", "60"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # a reservoir smaller than the requests the 60 s complete, so the replay samples them: the
    # reference kernels (AGENTX_KERNELS=ref) complete about 150, the compiled ones more than 200
    reservoir = 200 if kernels.cpu_kernels_enabled() else 100
    proc = subprocess.run(
        [*command, "--sessions", "4", "--replay-max", str(reservoir), "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["failures"] == []
    assert result["phases"] == 5 and result["faults"]["step_crash"] == 1
    replay = result["replay"]
    assert replay["num_completed"] > reservoir and replay["num_mismatches"] == 0
    assert replay["num_replayed"] == reservoir  # the reservoir holds --replay-max of them
    assert result["leaks"] == {"threads": [], "fds": [], "children": []}
    assert result["sessions_closed"] > 0 and result["sessions_abandoned"] > 0
    assert result["expected_errors"].get("EngineDeadError", 0) > 0  # the crash reached callers
