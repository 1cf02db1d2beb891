"""Saturation profiling (``agentx bench saturate``): an engine's best tokens/s as a prefill-only
instance and as a decode-only instance, at the sizes a trace asks for.

Buckets come from the trace's own distributions (:func:`derive_buckets`): prompt lengths and
cached fractions for prefill, context lengths for decode, each the trace's quantiles, rounded to
whole blocks and clipped to the model's context.

- Prefill probe (prompt length ``L`` x cached fraction ``f``): a shared prefix of
  ``floor(f * L)`` tokens, rounded down to whole blocks, is sent once to warm the cache; then
  enough requests of ``L`` tokens (that prefix plus a private rest) to fill the engine's steps
  (``prefill_tokens`` uncached tokens in all, at most ``max_requests``) go in together, one
  output token each. Rate: uncached tokens computed per second from the first submit to the
  last first token (``computed_tokens_per_s``), and the same with the cached part counted
  (``prompt_tokens_per_s``).
- Decode probe (batch ``B`` x context ``C``): ``B`` requests of ``C`` prompt tokens that share
  all but their last block (prefilled once: the probe measures decode, not prefill; with
  ``distinct_contexts`` each has its own, which a CPU's caches cannot share) each generate
  ``decode_tokens``. Rate: output tokens per second while all ``B`` decode (from the
  last first token to the first last token), and per-request interactivity (output tokens/s
  after the first token, P50 and P90 as in :mod:`agentx.bench.metrics`).
- At the floor: per context, the best decode rate among batches whose interactivity P90 is at
  least ``interactivity_floor`` (None when no batch reaches it).

Every probe has its own prompt scope, so no probe hits another's cache; one engine serves all
the probes of an engine spec, after a small warm-up request. :mod:`agentx.bench.pd_model` reads
the JSON this writes (:func:`profile_json`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from agentx.bench.adapter import Done, EngineAdapter, EngineInfo, GenerateRequest, Tokens
from agentx.bench.metrics import percentile
from agentx.bench.prompts import PromptBuilder
from agentx.bench.trace import Trace
from agentx.bench.trace_stats import theoretical_hits
from agentx.errors import ConfigError

PROFILE_KIND = "agentx-bench-saturation"
PROFILE_VERSION = 1


@dataclass(frozen=True, slots=True)
class SaturateConfig:
    quantiles: tuple[float, ...] = (0.1, 0.5, 0.9)
    batches: tuple[int, ...] = (1, 4, 16)
    decode_tokens: int = 32  # output tokens per decode-probe request
    prefill_tokens: int = 8192  # uncached tokens per prefill probe (all its requests)
    max_requests: int = 64  # requests per prefill probe at most
    interactivity_floor: float = 5.0  # tokens/s per request
    max_context: int = 8192  # the model's context: buckets are clipped to fit it
    # decode probes: every request its own context (prefilled in full; slow on a CPU) instead
    # of all but the last block shared (shared blocks may stay in a CPU's caches between reads)
    distinct_contexts: bool = False

    def __post_init__(self) -> None:
        if not self.quantiles or not all(0 <= q <= 1 for q in self.quantiles):
            raise ConfigError(f"quantiles must be in [0, 1], got {self.quantiles}")
        if not self.batches or min(self.batches) <= 0:
            raise ConfigError(f"batches must be positive, got {self.batches}")
        for name in ("prefill_tokens", "max_requests"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.decode_tokens < 2:
            raise ConfigError(f"decode_tokens must be >= 2, got {self.decode_tokens}")
        if self.interactivity_floor < 0:
            raise ConfigError(f"interactivity_floor must be >= 0, got {self.interactivity_floor}")
        if self.max_context <= self.decode_tokens:
            raise ConfigError(f"max_context is too small: {self.max_context}")


@dataclass(frozen=True, slots=True)
class Buckets:
    prompt_tokens: tuple[int, ...]  # prefill probes' prompt lengths
    cached_fractions: tuple[float, ...]  # prefill probes' cached fractions
    context_tokens: tuple[int, ...]  # decode probes' context lengths
    new_tokens: tuple[int, ...]  # the trace's uncached tokens per request, same quantiles (info)


def derive_buckets(trace: Trace, config: SaturateConfig) -> Buckets:
    """The trace's quantiles (``config.quantiles``) of prompt length, cached fraction (the
    theoretical hit tokens of :mod:`agentx.bench.trace_stats` over the prompt), context
    (prompt + output) and uncached tokens; lengths rounded up to whole blocks and clipped to
    ``max_context`` (a prompt leaves room for one output token, a context for
    ``decode_tokens``), fractions rounded down to hundredths; sorted, duplicates dropped."""
    bs, q = trace.block_size, config.quantiles
    requests = [r for _, r in trace.iter_requests()]
    if not requests:
        raise ConfigError(f"trace {trace.trace_id} has no requests")
    hits = theoretical_hits(trace)
    prompt = [r.num_input_tokens for r in requests]
    fraction = [
        h / r.num_input_tokens for r, h in zip(requests, hits, strict=True) if r.num_input_tokens
    ]
    context = [r.num_input_tokens + r.num_output_tokens for r in requests]
    new = [r.num_input_tokens - h for r, h in zip(requests, hits, strict=True)]
    max_prompt = (config.max_context - 1) // bs * bs
    max_ctx = (config.max_context - config.decode_tokens) // bs * bs
    return Buckets(
        prompt_tokens=_lengths(prompt, q, bs, max_prompt),
        cached_fractions=tuple(
            sorted({math.floor(percentile(fraction, x) * 100) / 100 for x in q})
        ),
        context_tokens=_lengths(context, q, bs, max_ctx),
        new_tokens=tuple(sorted({math.ceil(percentile(new, x)) for x in q})),
    )


def _lengths(values: list[int], quantiles: Sequence[float], bs: int, cap: int) -> tuple[int, ...]:
    return tuple(
        sorted({min(cap, max(bs, math.ceil(percentile(values, x) / bs) * bs)) for x in quantiles})
    )


def cached_prefix_tokens(prompt_tokens: int, fraction: float, block_size: int) -> int:
    """Whole blocks of ``fraction * prompt_tokens``, leaving at least one token uncached."""
    cached = math.floor(fraction * prompt_tokens / block_size) * block_size
    return cached - block_size if cached >= prompt_tokens else cached


class _Drained:
    __slots__ = ("token_times", "num_cached")

    def __init__(self) -> None:
        self.token_times: list[float] = []
        self.num_cached: int | None = None


async def _drain(adapter: EngineAdapter, request: GenerateRequest, t0: float) -> _Drained:
    out = _Drained()
    async for event in adapter.generate(request):
        if isinstance(event, Tokens):
            out.token_times.extend([time.perf_counter() - t0] * event.n)
        elif isinstance(event, Done):
            out.num_cached = event.num_cached
    return out


class Prober:
    """Runs the probes of one started engine; prompts come from ``prompts`` by scope."""

    def __init__(self, adapter: EngineAdapter, prompts: PromptBuilder, config: SaturateConfig):
        self.adapter, self.prompts, self.config = adapter, prompts, config
        self.block_size = prompts.block_size

    def _request(self, scope: str, key: str, num_shared: int, num_tokens: int, num_out: int):
        ids = tuple(range(num_shared // self.block_size))
        prompt = self.prompts.prompt(scope, ids, num_tokens, filler_key=key)
        return GenerateRequest(f"{scope}/{key}", f"{scope}/{key}", prompt, num_out)

    async def _warm(self, scope: str, num_shared: int) -> None:
        if num_shared:
            await _drain(self.adapter, self._request(scope, "warm", num_shared, num_shared, 1), 0)

    async def warm_up(self) -> None:
        """One small request first, so the first probe does not pay for lazy start-up."""
        await _drain(self.adapter, self._request("saturate/warm-up", "0", 0, 64, 4), 0)

    async def prefill(self, prompt_tokens: int, fraction: float) -> dict:
        scope = f"saturate/prefill/{prompt_tokens}/{fraction:g}"
        cached = cached_prefix_tokens(prompt_tokens, fraction, self.block_size)
        num_new = prompt_tokens - cached
        n = max(1, min(self.config.max_requests, math.ceil(self.config.prefill_tokens / num_new)))
        await self._warm(scope, cached)
        requests = [self._request(scope, str(i), cached, prompt_tokens, 1) for i in range(n)]
        t0 = time.perf_counter()
        done = await asyncio.gather(*(_drain(self.adapter, r, t0) for r in requests))
        elapsed = max((d.token_times[0] for d in done if d.token_times), default=0.0)
        reported = [d.num_cached for d in done if d.num_cached is not None]
        return {
            "prompt_tokens": prompt_tokens,
            "cached_fraction": fraction,
            "cached_tokens": cached,
            "num_requests": n,
            "elapsed_s": elapsed,
            "computed_tokens_per_s": _rate(n * num_new, elapsed),
            "prompt_tokens_per_s": _rate(n * prompt_tokens, elapsed),
            "ttft_p50": percentile([d.token_times[0] for d in done if d.token_times], 0.5),
            "num_cached_reported": sum(reported) if reported else None,
        }

    async def decode(self, batch: int, context_tokens: int) -> dict:
        scope = f"saturate/decode/{batch}/{context_tokens}"
        shared = 0 if self.config.distinct_contexts else max(0, context_tokens - self.block_size)
        await self._warm(scope, shared)
        n_out = self.config.decode_tokens
        requests = [
            self._request(scope, str(i), shared, context_tokens, n_out) for i in range(batch)
        ]
        t0 = time.perf_counter()
        done = await asyncio.gather(*(_drain(self.adapter, r, t0) for r in requests))
        times = [d.token_times for d in done if d.token_times]
        rates = [(len(t) - 1) / (t[-1] - t[0]) for t in times if len(t) > 1 and t[-1] > t[0]]
        reported = [d.num_cached for d in done if d.num_cached is not None]
        return {
            "batch": batch,
            "context_tokens": context_tokens,
            "tokens_per_s": steady_tokens_per_s(times),
            "interactivity_p50": percentile(rates, 0.5),
            "interactivity_p90": percentile(rates, 0.1),
            "ttft_p50": percentile([t[0] for t in times], 0.5),
            "num_cached_reported": sum(reported) if reported else None,
        }


def steady_tokens_per_s(times: Sequence[Sequence[float]]) -> float:
    """Output tokens/s while every request decodes: tokens received after the last first token
    up to the first last token, over that window. Requests that never overlap: every token
    after each request's first, over the first first token to the last last token."""
    if not times:
        return 0.0
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    if end > start:
        return sum(1 for t in times for x in t if start < x <= end) / (end - start)
    first, last = min(t[0] for t in times), max(t[-1] for t in times)
    return _rate(sum(len(t) - 1 for t in times), last - first)


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def at_floor(decode: Sequence[dict], floor: float) -> list[dict]:
    """Per context: the best decode tokens/s among batches whose interactivity P90 reaches
    ``floor`` (``tokens_per_s`` None, ``batch`` None when none does)."""
    out = []
    for context in sorted({d["context_tokens"] for d in decode}):
        ok = [
            d
            for d in decode
            if d["context_tokens"] == context
            and d["interactivity_p90"] is not None
            and d["interactivity_p90"] >= floor
        ]
        best = max(ok, key=lambda d: d["tokens_per_s"], default=None)
        out.append(
            {
                "context_tokens": context,
                "batch": best["batch"] if best else None,
                "tokens_per_s": best["tokens_per_s"] if best else None,
            }
        )
    return out


async def profile_engine(
    factory: Callable[[], EngineAdapter],
    buckets: Buckets,
    prompts: PromptBuilder,
    config: SaturateConfig,
    log: Callable[[str], None] = lambda _: None,
) -> dict:
    """Start one engine, run every probe on it, close it; the engine's part of the profile."""
    adapter = factory()
    try:
        info: EngineInfo = await adapter.start()
        prober = Prober(adapter, prompts, config)
        await prober.warm_up()
        prefill = []
        for length in buckets.prompt_tokens:
            for fraction in buckets.cached_fractions:
                prefill.append(await prober.prefill(length, fraction))
                log(f"prefill {length} tokens, {fraction:.0%} cached: "
                    f"{prefill[-1]['computed_tokens_per_s']:,.0f} tok/s")  # fmt: skip
        decode = []
        for context in buckets.context_tokens:
            for batch in config.batches:
                decode.append(await prober.decode(batch, context))
                log(f"decode batch {batch} at {context} tokens: "
                    f"{decode[-1]['tokens_per_s']:,.1f} tok/s")  # fmt: skip
    finally:
        await adapter.close()
    return {
        "info": asdict(info),
        "prefill": prefill,
        "decode": decode,
        "decode_at_floor": at_floor(decode, config.interactivity_floor),
    }


def profile_json(trace_info: dict, config: SaturateConfig, buckets: Buckets, engines: dict) -> dict:
    """The file :mod:`agentx.bench.pd_model` loads: ``engines`` maps a spec name to
    :func:`profile_engine`'s dict."""
    return {
        "kind": PROFILE_KIND,
        "version": PROFILE_VERSION,
        "trace": trace_info,
        "config": asdict(config),
        "buckets": asdict(buckets),
        "engines": engines,
    }
