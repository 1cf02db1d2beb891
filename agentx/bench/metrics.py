"""Metrics of one run, computed from its request records only.

Definitions (over the requests that finished without error):
- TPGS: (every prompt token, cached or not, + every output token) / wall time / devices.
- TTFT: first output token's receipt - submit. P50 / P90: 50th / 90th percentile.
- Interactivity: a request's output tokens per second after its first token,
  ``(n - 1) / (t_last - t_first)`` (requests with fewer than 2 tokens have none).
  P50 is the median; P90 is the rate that 90% of requests reach, i.e. the 10th percentile
  (the tail is the slow side, as for TTFT).
- Achieved hit rate: prompt tokens the engine reports as cached / prompt tokens (None when the
  engine reports nothing). Theoretical: see :mod:`agentx.bench.trace_stats`.
- Computed prompt tokens: prompt - cached. Recomputed tokens: sum over requests of
  ``max(0, theoretical hit tokens - cached)``: tokens the trace had sent before that the
  engine computed again.
- TPGS at an interactivity floor (over a sweep): the best TPGS among runs whose interactivity
  P90 is at least the floor.
Percentiles interpolate linearly between order statistics (NumPy's default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from agentx.bench.records import RunResult


@dataclass(frozen=True, slots=True)
class RunMetrics:
    engine: str
    concurrency: int
    wall_time: float
    num_requests: int
    num_failed: int
    num_prompt_tokens: int
    num_output_tokens: int
    tpgs: float
    output_tokens_per_s: float
    ttft_p50: float | None
    ttft_p90: float | None
    interactivity_p50: float | None
    interactivity_p90: float | None
    achieved_hit_rate: float | None
    theoretical_hit_rate: float
    num_cached_tokens: int | None
    num_computed_prompt_tokens: int | None
    num_recomputed_tokens: int | None
    interrupted: bool
    # drafted tokens the target model accepted / drafted (agentx's drafting from context; None
    # when the engine reports no drafting counters)
    draft_acceptance: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def run_metrics(result: RunResult) -> RunMetrics:
    ok = [r for r in result.records if r.ok]
    prompt = sum(r.num_prompt_tokens for r in ok)
    output = sum(r.num_output_tokens for r in ok)
    wall = result.wall_time
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    rates = [r.interactivity for r in ok if r.interactivity is not None]
    reported = [r for r in ok if r.num_cached_tokens is not None]
    cached = sum(r.num_cached_tokens for r in reported) if reported else None
    recomputed = (
        sum(max(0, r.theoretical_hit_tokens - r.num_cached_tokens) for r in reported)
        if reported
        else None
    )
    reported_prompt = sum(r.num_prompt_tokens for r in reported)
    return RunMetrics(
        engine=result.engine.engine,
        concurrency=result.concurrency,
        wall_time=wall,
        num_requests=len(ok),
        num_failed=len(result.records) - len(ok),
        num_prompt_tokens=prompt,
        num_output_tokens=output,
        tpgs=(prompt + output) / wall / result.num_devices if wall > 0 else 0.0,
        output_tokens_per_s=output / wall if wall > 0 else 0.0,
        ttft_p50=percentile(ttfts, 0.5),
        ttft_p90=percentile(ttfts, 0.9),
        interactivity_p50=percentile(rates, 0.5),
        interactivity_p90=percentile(rates, 0.1),
        achieved_hit_rate=cached / reported_prompt if reported and reported_prompt else None,
        theoretical_hit_rate=sum(r.theoretical_hit_tokens for r in ok) / prompt if prompt else 0.0,
        num_cached_tokens=cached,
        num_computed_prompt_tokens=reported_prompt - cached if reported else None,
        num_recomputed_tokens=recomputed,
        interrupted=result.interrupted,
        draft_acceptance=draft_acceptance(result.engine_stats),
    )


def draft_acceptance(stats: dict | None) -> float | None:
    """Accepted / drafted tokens from an engine's final counters (a router's replicas summed)."""
    if not stats:
        return None
    parts = stats.get("replicas", [stats])
    drafted = sum(p.get("num_draft_tokens", 0) for p in parts)
    accepted = sum(p.get("num_accepted_tokens", 0) for p in parts)
    return accepted / drafted if drafted else None


def tpgs_at_floor(runs: Sequence[RunMetrics], floor: float) -> float | None:
    """Best TPGS among runs whose interactivity P90 reaches ``floor`` tokens/s."""
    ok = [m.tpgs for m in runs if m.interactivity_p90 is not None and m.interactivity_p90 >= floor]
    return max(ok) if ok else None
