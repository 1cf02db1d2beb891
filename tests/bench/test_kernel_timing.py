"""The kernel benchmarks' shared timing (agentx/bench/kernel_timing.py)."""

from __future__ import annotations

import argparse
import time

import pytest
import torch

from agentx.bench import kernel_timing


def test_best_time_warms_up_once_then_keeps_the_fastest_round() -> None:
    calls = []
    ticks = iter([0.0, 5.0, 10.0, 12.0, 20.0, 27.0])  # rounds of 5, 2 and 7 seconds
    best = kernel_timing.best_time(lambda: calls.append(1), 3, lambda: next(ticks))
    assert best == 2.0
    assert len(calls) == 4  # the warm-up and three timed calls


def test_best_time_runs_before_untimed_ahead_of_each_timed_call() -> None:
    events = []
    ticks = iter([0.0, 3.0, 10.0, 11.0])  # rounds of 3 and 1 seconds

    def clock() -> float:
        events.append("tick")
        return next(ticks)

    best = kernel_timing.best_time(
        lambda: events.append("call"), 2, clock, before=lambda: events.append("before")
    )
    assert best == 1.0
    # the warm-up without it; each round: before, then the clock around the call
    assert events == ["call"] + ["before", "tick", "call", "tick"] * 2


def test_timing_flags_and_their_clock() -> None:
    parser = argparse.ArgumentParser()
    kernel_timing.add_timing_args(parser, rows="8,64", rounds=3)
    args = parser.parse_args([])
    assert (args.rows, args.threads, args.rounds, args.cpu_time) == ("8,64", 2, 3, False)
    assert kernel_timing.clock_of(args) is time.perf_counter
    args = parser.parse_args(["--cpu-time", "--threads", "1"])
    assert kernel_timing.clock_of(args) is time.thread_time
    with pytest.raises(SystemExit, match="use it with --threads 1"):
        kernel_timing.clock_of(parser.parse_args(["--cpu-time"]))
    threads = torch.get_num_threads()
    try:
        args = parser.parse_args(["--rows", "6,512", "--threads", "1"])
        clock, rows = kernel_timing.timing_setup(args)
        assert clock is time.perf_counter and rows == [6, 512] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_header_names_the_cpu_model_and_the_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        kernel_timing,
        "machine_info",
        lambda: {"cpu": "AMD EPYC (family 23 model 49; avx2)", "cores": 2, "loadavg_1m": 0.1},
    )
    monkeypatch.setattr(kernel_timing, "versions", lambda: {"git": "abc1234", "torch": "2.13.0"})
    line = kernel_timing.header(1, "avx2")
    assert line.startswith("# AMD EPYC (family 23 model 49; avx2), 2 CPUs, load 0.1, 1 threads,")
    assert "ISA avx2, agentx abc1234 (" in line and line.endswith("), torch 2.13.0")
