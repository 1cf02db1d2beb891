"""The results file: machine, versions, trace, configuration, and every run with its records.

Layout (JSON)::

    {"kind": "agentx-bench-results", "version": 1, "created": ISO time, "command": [...],
     "machine": {...}, "versions": {...}, "trace": {"id", "path", "stats"}, "config": {...},
     "runs": [RunResult.to_json() + {"metrics": RunMetrics.to_json()}, ...],
     "summary": {"interactivity_floor", "tpgs_at_floor": {engine: value}, "ratios_vs": str,
                 "ratios": {engine: {concurrency: tpgs / reference tpgs}}}}
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from agentx.bench.metrics import RunMetrics, run_metrics, tpgs_at_floor
from agentx.bench.records import RunResult

RESULTS_KIND = "agentx-bench-results"


def machine_info() -> dict:
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_gib": _ram_gib(),
        "platform": platform.platform(),
        "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
    }


def versions() -> dict:
    import agentx

    out = {"python": platform.python_version(), "agentx": agentx.__version__, "git": _git_rev()}
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        out["torch"] = None
    return out


# the flags that pick a kernel path (agentx/kernels/cpu): a record names the ISA its figures ran on
_ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def _cpu_model() -> str:
    """The CPU's model name, with its family / model numbers and the ISA flags that choose the
    kernels: a virtual machine often names every AMD generation just "AMD EPYC"."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    return cpu_model_from(text) or platform.processor() or platform.machine()


def cpu_model_from(cpuinfo: str) -> str:
    """E.g. 'AMD EPYC (family 23 model 49; avx2)' from /proc/cpuinfo's text; '' if it names none."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block says it for all
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "")
    if not name:
        return ""
    flags = set(fields.get("flags", "").split())
    isa = ", ".join(f for f in _ISA_FLAGS if f in flags) or "no avx2"
    family, model = fields.get("cpu family", "?"), fields.get("model", "?")
    return f"{name} (family {family} model {model}; {isa})"


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def _git_rev() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


@dataclass(frozen=True, slots=True)
class Results:
    """A results file in memory: the header fields and the runs, in run order."""

    header: dict
    runs: tuple[RunResult, ...]

    @property
    def metrics(self) -> list[RunMetrics]:
        return [run_metrics(r) for r in self.runs]

    def summary(self, floor: float) -> dict:
        """TPGS at the floor per engine, and TPGS ratios against the reference engine: the
        first engine whose name starts with "agentx", else the first engine."""
        metrics = self.metrics
        engines = list(dict.fromkeys(m.engine for m in metrics))
        agentx = [e for e in engines if e.startswith("agentx")]
        reference = (agentx or engines or ["agentx"])[0]
        ref = {m.concurrency: m.tpgs for m in metrics if m.engine == reference}
        ratios = {
            e: {
                str(m.concurrency): m.tpgs / ref[m.concurrency]
                for m in metrics
                if m.engine == e and ref.get(m.concurrency)
            }
            for e in engines
        }
        return {
            "interactivity_floor": floor,
            "tpgs_at_floor": {
                e: tpgs_at_floor([m for m in metrics if m.engine == e], floor) for e in engines
            },
            "ratios_vs": reference,
            "ratios": ratios,
        }

    def to_json(self, floor: float) -> dict:
        runs = []
        for run, m in zip(self.runs, self.metrics, strict=True):
            runs.append({**run.to_json(), "metrics": m.to_json()})
        return {**self.header, "runs": runs, "summary": self.summary(floor)}

    def write(self, path: str | Path, floor: float) -> None:
        Path(path).write_text(json.dumps(self.to_json(floor), indent=1))

    @classmethod
    def read(cls, path: str | Path) -> Results:
        obj = json.loads(Path(path).read_text())
        if obj.get("kind") != RESULTS_KIND:
            raise ValueError(f"{path}: not an agentx bench results file")
        header = {k: v for k, v in obj.items() if k not in ("runs", "summary")}
        return cls(header, tuple(RunResult.from_json(r) for r in obj["runs"]))


def make_header(trace_info: dict, config: dict) -> dict:
    return {
        "kind": RESULTS_KIND,
        "version": 1,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": sys.argv,
        "machine": machine_info(),
        "versions": versions(),
        "trace": trace_info,
        "config": config,
    }
