"""Predict prefill/decode-disaggregated throughput from a saturation profile.

A profile (``saturation.json`` from ``agentx bench saturate``, :mod:`agentx.bench.saturate`)
says how fast one instance prefills (uncached tokens/s by prompt length and cached fraction) and
decodes (output tokens/s at the interactivity floor, by context). A demand is the trace's
requests as (prompt, cached, output) token counts (:func:`trace_demand`). The model:

- One prefill instance needs ``P = sum(computed_i / prefill_rate(prompt_i, cached_i /
  prompt_i))`` busy seconds for the whole demand, one decode instance
  ``D = sum(output_i / decode_rate(prompt_i + output_i / 2))`` (a request decodes on an
  average context of its prompt plus half its output).
- ``x`` prefill + ``y`` decode instances (xPyD) finish in ``max(P / x, D / y)``; ``x + y``
  colocated instances, each doing both by time-sharing, in ``(P + D) / (x + y)``.
- Throughput is the demand's tokens (every prompt token, cached or not, plus every output
  token: TPGS's numerator) over that time; per instance, over ``x + y`` as well.

Rates between buckets interpolate linearly in the length and are held flat past the ends;
prefill uses the row of the profile's cached fraction nearest the request's (ties: the lower).
Not modelled: moving KV from prefill to decode instances, queueing, a colocated instance
batching prefill beside decode (it may beat time-sharing), and the cache a warm turn's decode
instance would already hold. It is a first-order estimate to rank xPyD splits, not a simulator.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from agentx.bench.saturate import PROFILE_KIND
from agentx.bench.trace import Trace
from agentx.bench.trace_stats import theoretical_hits


@dataclass(frozen=True, slots=True)
class RequestDemand:
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int

    @property
    def num_computed_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_cached_tokens


def trace_demand(trace: Trace) -> list[RequestDemand]:
    """Every request of ``trace``, its cached tokens being its theoretical prefix hits."""
    hits = theoretical_hits(trace)
    return [
        RequestDemand(r.num_input_tokens, h, r.num_output_tokens)
        for (_, r), h in zip(trace.iter_requests(), hits, strict=True)
    ]


@dataclass(frozen=True, slots=True)
class SaturationProfile:
    """One engine's rates: ``prefill`` maps a cached fraction to (prompt tokens, computed
    tokens/s) points, ``decode`` is (context tokens, output tokens/s at the floor) points."""

    prefill: dict[float, tuple[tuple[int, float], ...]]
    decode: tuple[tuple[int, float], ...]
    floor: float

    @classmethod
    def from_json(cls, obj: dict, engine: str | None = None) -> SaturationProfile:
        """``engine``'s part of a saturation.json object (None: its only engine). Decode
        contexts where no batch reached the floor are left out."""
        if obj.get("kind") != PROFILE_KIND:
            raise ValueError(f"not a saturation profile: kind {obj.get('kind')!r}")
        engines = obj["engines"]
        if engine is None:
            if len(engines) != 1:
                raise ValueError(f"the profile has engines {sorted(engines)}: name one")
            engine = next(iter(engines))
        part = engines[engine]
        rows: dict[float, list[tuple[int, float]]] = {}
        for p in part["prefill"]:
            rows.setdefault(p["cached_fraction"], []).append(
                (p["prompt_tokens"], p["computed_tokens_per_s"])
            )
        decode = [
            (d["context_tokens"], d["tokens_per_s"])
            for d in part["decode_at_floor"]
            if d["tokens_per_s"]
        ]
        return cls(
            {f: tuple(sorted(r)) for f, r in rows.items()},
            tuple(sorted(decode)),
            obj["config"]["interactivity_floor"],
        )

    def get_prefill_rate(self, prompt_tokens: int, cached_fraction: float) -> float:
        if not self.prefill:
            raise ValueError("the profile has no prefill points")
        row = min(self.prefill, key=lambda f: (abs(f - cached_fraction), f))
        return interpolate(self.prefill[row], prompt_tokens)

    def get_decode_rate(self, context_tokens: float) -> float:
        if not self.decode:
            raise ValueError(f"no decode point of the profile reaches the {self.floor} tok/s floor")
        return interpolate(self.decode, context_tokens)


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Linear between sorted ``(x, y)`` points, flat past either end."""
    xs = [p[0] for p in points]
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True, slots=True)
class PDPrediction:
    num_prefill: int
    num_decode: int
    prefill_busy_s: float  # one prefill instance's seconds for the whole demand
    decode_busy_s: float  # one decode instance's seconds for the whole demand
    num_tokens: int  # the demand's prompt + output tokens
    tokens_per_s: float  # xPyD
    colocated_tokens_per_s: float  # x + y colocated instances
    bottleneck: str  # "prefill" or "decode": the pool that finishes last

    @property
    def tokens_per_s_per_instance(self) -> float:
        return self.tokens_per_s / (self.num_prefill + self.num_decode)

    @property
    def speedup(self) -> float:
        """xPyD over colocated on the same number of instances."""
        return self.tokens_per_s / self.colocated_tokens_per_s


def predict_pd(
    profile: SaturationProfile,
    demand: Sequence[RequestDemand],
    num_prefill: int,
    num_decode: int,
) -> PDPrediction:
    """Throughput of ``num_prefill`` prefill + ``num_decode`` decode instances on ``demand``,
    beside the same number of colocated instances (see the module docstring)."""
    if num_prefill <= 0 or num_decode <= 0:
        raise ValueError(
            f"need at least one instance of each kind, got {num_prefill}P{num_decode}D"
        )
    if not demand:
        raise ValueError("empty demand")
    prefill_s = sum(
        d.num_computed_tokens
        / profile.get_prefill_rate(d.num_prompt_tokens, d.num_cached_tokens / d.num_prompt_tokens)
        for d in demand
        if d.num_computed_tokens
    )
    decode_s = sum(
        d.num_output_tokens / profile.get_decode_rate(d.num_prompt_tokens + d.num_output_tokens / 2)
        for d in demand
        if d.num_output_tokens
    )
    tokens = sum(d.num_prompt_tokens + d.num_output_tokens for d in demand)
    pd_time = max(prefill_s / num_prefill, decode_s / num_decode)
    colocated_time = (prefill_s + decode_s) / (num_prefill + num_decode)
    return PDPrediction(
        num_prefill=num_prefill,
        num_decode=num_decode,
        prefill_busy_s=prefill_s,
        decode_busy_s=decode_s,
        num_tokens=tokens,
        tokens_per_s=tokens / pd_time,
        colocated_tokens_per_s=tokens / colocated_time,
        bottleneck="prefill" if prefill_s / num_prefill >= decode_s / num_decode else "decode",
    )
