"""What the compiled-kernel benchmarks (`benchmarks/qlinear_bench.py`, `kquant_gemm_bench.py`)
share: their timing flags, their clock, a best-of timer and the header line naming the machine."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import agentx
from agentx.bench.results import machine_info, versions


def add_timing_args(parser: argparse.ArgumentParser, rows: str, rounds: int) -> None:
    """--rows (comma-separated M values), --threads, --rounds and --cpu-time."""
    parser.add_argument("--rows", default=rows, help="comma-separated M values")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the calling thread's CPU seconds (with --threads 1: steadier on a loaded box)",
    )


def clock_of(args: argparse.Namespace) -> Callable[[], float]:
    """The calling thread's CPU time with --cpu-time (one thread only), else the wall clock."""
    if args.cpu_time and args.threads != 1:
        raise SystemExit("--cpu-time measures the calling thread only: use it with --threads 1")
    return time.thread_time if args.cpu_time else time.perf_counter


def timing_setup(args: argparse.Namespace) -> tuple[Callable[[], float], list[int]]:
    """The clock (clock_of), torch's threads set to --threads, and --rows as integers."""
    import torch

    clock = clock_of(args)
    torch.set_num_threads(args.threads)
    return clock, [int(r) for r in args.rows.split(",")]


def best_time(
    call: Callable[[], object],
    rounds: int,
    clock: Callable[[], float],
    before: Callable[[], object] | None = None,
) -> float:
    """One warm-up call, then the fastest of `rounds` timed calls, in seconds; ``before`` (if
    given) runs untimed ahead of each timed call."""
    call()
    best = float("inf")
    for _ in range(rounds):
        if before is not None:
            before()
        start = clock()
        call()
        best = min(best, clock() - start)
    return best


def header(threads: int, isa: str) -> str:
    """'# <CPU model>, N CPUs, load L, T threads, ISA I, agentx <commit> (<package>), torch V'."""
    machine, version = machine_info(), versions()
    return (
        f"# {machine['cpu']}, {machine['cores']} CPUs, load {machine['loadavg_1m']}, "
        f"{threads} threads, ISA {isa}, agentx {version['git']} "
        f"({Path(agentx.__file__).parent}), torch {version['torch']}"
    )
