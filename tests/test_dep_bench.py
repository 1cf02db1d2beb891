"""benchmarks/dep_bench.py runs every mode end to end on its random hybrid MoE model (it once
built 16-token blocks while the hybrid layout widened them, and failed in the input batch).
The figures are in docs/bench/dep-2026-12-04.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_dep_bench_runs_every_mode(tmp_path):
    out = tmp_path / "dep.json"
    command = [sys.executable, str(ROOT / "benchmarks/dep_bench.py"), "--hidden", "256"]
    command += ["--steps", "2", "--tokens", "64", "--repeat", "1", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    modes = {(r["mode"], r["workload"]) for r in rows}
    assert {m for m, _ in modes} == {"ep1", "ep2", "dep2-a2a", "dep2-allgather"}
    assert len(modes) == 12  # 4 modes x (decode, prefill of 1 request, prefill of 8)
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert all(len(r["comm_share_per_rank"]) == r["world_size"] for r in rows)
