"""The soak over a topology (benchmarks/soak_topology.py), short: a ReplicaRouter with dp=2 and
a DisaggCoordinator, one replica or instance killed mid-phase. Every completed greedy request
equals a fault-free engine's tokens, a turn the kill ended failed with EngineDeadError and its
session was served again, nothing is left held or used, no process, thread or file leaked.
The longer runs and their figures are in docs/bench/soak-2026-12-03.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
KILLS = {
    "dp2": ["none", "kill_replica_tier", "kill_replica_recompute"],
    "pd": ["none", "kill_prefill", "kill_decode"],
}


@pytest.mark.parametrize("topology", sorted(KILLS))
def test_a_killed_replica_or_instance_loses_nothing(tmp_path, topology):
    out = tmp_path / "soak.json"
    command = [sys.executable, str(ROOT / "benchmarks/soak.py"), "--topology", topology]
    options = ["--seconds", "24", "--phase-seconds", "8", "--sessions", "4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [*command, *options, "--replay-max", "100", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["failures"] == []
    assert [p["fault"] for p in result["per_phase"]] == KILLS[topology]
    assert [len(p["killed"]) for p in result["per_phase"]] == [0, 1, 1]
    replay = result["replay"]
    assert replay["num_completed"] > 20 and replay["num_mismatches"] == 0
    assert result["leaks"] == {"threads": [], "fds": [], "children": []}
    surfaced = set(result["expected_errors"]) - {"RequestAbortedError", "SessionClosedError"}
    assert surfaced <= {"EngineDeadError", "InstanceDeadError"}  # a kill is said as a death
