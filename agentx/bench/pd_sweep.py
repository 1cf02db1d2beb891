"""The P/D sweep's splits, predictions, best-split choice and report (benchmarks/pd_sweep.py
runs them): N workers as the colocated baseline and as every xPyD with x + y = N.

A prediction is :func:`agentx.bench.pd_model.predict_pd` on a trace's demand, per split, in
tokens/s per worker so it reads beside the measured TPGS (:mod:`agentx.bench.metrics`, per
worker too). The best split at an interactivity floor is the highest TPGS among the runs that
failed nothing, ran to the end and whose interactivity P90 reaches the floor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentx.bench.metrics import RunMetrics
from agentx.bench.pd_model import RequestDemand, SaturationProfile, predict_pd
from agentx.errors import ConfigError

SWEEP_KIND = "agentx-bench-pd-sweep"
COLOCATED = "colocated"


@dataclass(frozen=True, slots=True)
class Split:
    """``num_workers`` engines: ``num_prefill`` P + the rest D, or (``num_prefill`` 0) all
    colocated."""

    num_workers: int
    num_prefill: int

    @property
    def num_decode(self) -> int:
        return self.num_workers - self.num_prefill

    @property
    def colocated(self) -> bool:
        return self.num_prefill == 0

    @property
    def name(self) -> str:
        return COLOCATED if self.colocated else f"{self.num_prefill}P{self.num_decode}D"


def enumerate_splits(num_workers: int) -> list[Split]:
    """The colocated baseline, then every xPyD with x + y = ``num_workers``, x ascending."""
    if num_workers < 2:
        raise ConfigError(f"a P/D split needs at least 2 workers, got {num_workers}")
    return [Split(num_workers, x) for x in range(num_workers)]


@dataclass(frozen=True, slots=True)
class Prediction:
    split: str
    tokens_per_s: float  # all workers
    tokens_per_s_per_worker: float  # comparable with the measured TPGS
    bottleneck: str | None  # xPyD: the pool that finishes last; colocated: None


def predict_splits(
    profile: SaturationProfile, demand: Sequence[RequestDemand], splits: Sequence[Split]
) -> dict[str, Prediction]:
    """Each split's predicted throughput on ``demand`` (``predict_pd``): xPyD its
    ``tokens_per_s``, colocated the ``colocated_tokens_per_s`` of any split of as many."""
    out = {}
    for split in splits:
        if split.colocated:
            pred = predict_pd(profile, demand, 1, split.num_workers - 1)
            rate, bottleneck = pred.colocated_tokens_per_s, None
        else:
            pred = predict_pd(profile, demand, split.num_prefill, split.num_decode)
            rate, bottleneck = pred.tokens_per_s, pred.bottleneck
        out[split.name] = Prediction(split.name, rate, rate / split.num_workers, bottleneck)
    return out


def best_split(rows: Sequence[RunMetrics], floor: float) -> RunMetrics | None:
    """The highest TPGS among runs that failed nothing, were not interrupted and whose
    interactivity P90 is at least ``floor`` (the first of equals); None if none qualifies."""
    ok = [
        m
        for m in rows
        if m.num_failed == 0
        and not m.interrupted
        and m.interactivity_p90 is not None
        and m.interactivity_p90 >= floor
    ]
    return max(ok, key=lambda m: m.tpgs, default=None)


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _paths(stats: dict | None) -> str:
    """Hand-overs / local prefills of a P/D run; "-" for the colocated one."""
    if not stats or "counters" not in stats:
        return "-"
    c = stats["counters"]
    return f"{c['num_handovers']} / {c['num_local_prefills']}"


def table(rows: Sequence[tuple[RunMetrics, dict | None]], predictions: dict[str, Prediction]):
    head = (
        "| split | predicted tok/s/worker | TPGS tok/s/worker | measured / predicted | "
        "TTFT P50 s | TTFT P90 s | inter. P50 tok/s | inter. P90 tok/s | hit achieved | "
        "failed | hand-overs / local prefills | wall s |"
    )
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for m, stats in rows:
        pred = predictions.get(m.engine)
        per_worker = pred.tokens_per_s_per_worker if pred else None
        ratio = m.tpgs / per_worker if per_worker else None
        hit = "-" if m.achieved_hit_rate is None else f"{m.achieved_hit_rate:.1%}"
        lines.append(
            f"| {m.engine} | {_num(per_worker, '.0f')} | {m.tpgs:.0f} | {_num(ratio, '.2f')} | "
            f"{_num(m.ttft_p50, '.2f')} | {_num(m.ttft_p90, '.2f')} | "
            f"{_num(m.interactivity_p50, '.1f')} | {_num(m.interactivity_p90, '.1f')} | {hit} | "
            f"{m.num_failed} | {_paths(stats)} | {m.wall_time:.1f} |"
        )
    return "\n".join(lines)


def best_line(rows: Sequence[RunMetrics], floor: float) -> str:
    best = best_split(rows, floor)
    if best is None:
        return f"best split at interactivity P90 >= {floor:g} tok/s: none reaches the floor"
    return (
        f"best split at interactivity P90 >= {floor:g} tok/s: {best.engine} "
        f"({best.tpgs:.0f} tok/s/worker, interactivity P90 {best.interactivity_p90:.1f})"
    )


def plot_rows(runs: Sequence[dict]) -> list[dict]:
    """The JSON runs as ``plot_pd_sweep`` reads them."""
    return [
        {
            "split": r["split"],
            "predicted": (r["prediction"] or {}).get("tokens_per_s_per_worker"),
            "tpgs": r["metrics"]["tpgs"],
            "interactivity_p90": r["metrics"]["interactivity_p90"],
        }
        for r in runs
    ]
