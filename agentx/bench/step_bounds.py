"""What an engine step's work costs at best on this machine: its bytes over the read bandwidth
and its multiply-adds over the rates the kernels reach at their best (``step_profile.py``
prints both beside the step's measured time).

A step's work, from the model's shapes and the scheduled rows alone::

    linear layers   rows x in x out multiply-adds a layer; their packed weights read once a step
    LM head         one row per sampled token (and per draft, per prompt-logprob target)
    attention       per row and layer: keys x query heads x head_dim x 2 (scores and values);
                    per request and layer its keys' K and V rows read once (a tile shares them)

Rates, measured at the engine's thread count: the read bandwidth (torch summing 1 GiB), the
linear kernels' and the LM head's multiply-adds a second on 256 rows (compute-bound: each
weight serves every row), and attention's products from ``torch.mm`` on cache-resident 512 x
512 matrices of the type its kernel multiplies in: bf16 where a bf16 cache runs the AVX-512
loops (VDPBF16PS, scores and value sums alike: ``attention_products``), float32 otherwise (AVX2
and AVX-512 CPUs without BF16 take the same bf16 products as two FMAs; int8 caches' integer
dot products are counted at the float32 rate too). 512, not 256: under ``OMP_WAIT_POLICY=
PASSIVE`` (agentx's default) each call wakes torch's threads, which cost 256^3 products a
quarter of their rate (Zen 4, 2 threads: ~65 against ~85 GMAC/s). The memory floor and the
compute floor of a step are each a lower bound; a step that overlapped its reads and its
arithmetic perfectly would take the larger.

This module measures nothing of a step's time and knows nothing about scheduling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from agentx import kernels
from agentx.engine.models.attention import PagedAttention
from agentx.engine.models.layers import ParallelLMHead, QuantizableLinear
from agentx.errors import ConfigError
from agentx.kernels.cpu import attention_bf16_products


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The per-row costs of a model, from its modules."""

    linear_macs_per_row: int  # every layer's linear layers, one row
    linear_bytes: int  # their weights as kept (packed or float)
    lm_head_macs_per_row: int
    lm_head_bytes: int
    # per attention layer: (query heads, head_dim, sliding window or None, K + V bytes a token)
    attention: tuple[tuple[int, int, int | None, int], ...]


@dataclass(frozen=True, slots=True)
class RowSpan:
    """One request's share of a step: rows at positions [start, start + rows), of which
    ``logit_rows`` go through the LM head."""

    start: int
    rows: int
    logit_rows: int


@dataclass(frozen=True, slots=True)
class StepWork:
    linear_macs: float
    lm_head_macs: float
    attention_macs: float
    linear_bytes: float
    lm_head_bytes: float
    kv_bytes: float

    @property
    def bytes(self) -> float:
        return self.linear_bytes + self.lm_head_bytes + self.kv_bytes


@dataclass(frozen=True, slots=True)
class Rates:
    """Bytes and multiply-adds a second on this machine, at one thread count."""

    read_bytes: float
    linear_macs: float
    lm_head_macs: float
    attention_macs: float
    attention_products: str = "fp32"  # "bf16" or "fp32": what attention_macs was measured on


@dataclass(frozen=True, slots=True)
class Floors:
    """Seconds a step's work takes at best, per component and in all."""

    linear: tuple[float, float]  # (memory, compute)
    lm_head: tuple[float, float]
    attention: tuple[float, float]

    @property
    def memory(self) -> float:
        return self.linear[0] + self.lm_head[0] + self.attention[0]

    @property
    def compute(self) -> float:
        return self.linear[1] + self.lm_head[1] + self.attention[1]


def _linear_shape(linear: QuantizableLinear) -> tuple[int, int, int]:
    """(in, out, bytes) of a linear layer as the model keeps it."""
    own = [*linear.parameters(recurse=False), *linear.buffers(recurse=False)]
    size = sum(t.numel() * t.element_size() for t in own)
    if linear.bits == 0:
        out, fan_in = linear.weight.shape
        return fan_in, out, size
    with torch.no_grad():  # packed layouts differ by kind: the output width from one row
        out = linear._matmul(torch.zeros(1, linear.in_features)).shape[-1]
    return linear.in_features, out, size


def model_shape(model: nn.Module, kv_caches: list[torch.Tensor]) -> ModelShape:
    """The shape of a loaded model; ``kv_caches[layer_id]`` is that layer's cache
    ``(num_blocks, 2, block_size, kv_heads, row)``."""
    linear_macs = linear_bytes = head_macs = head_bytes = 0
    attention = []
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            fan_in, out, size = _linear_shape(module)
            head_macs, head_bytes = fan_in * out, size
        elif isinstance(module, QuantizableLinear):
            fan_in, out, size = _linear_shape(module)
            linear_macs += fan_in * out
            linear_bytes += size
        elif isinstance(module, PagedAttention):
            cache = kv_caches[module.layer_id]
            token = cache[0, :, 0].numel() * cache.element_size()
            attention.append((module.num_heads, module.head_dim, module.sliding_window, token))
    if not attention:
        raise ConfigError("step bounds: the model has no paged attention layer")
    return ModelShape(linear_macs, linear_bytes, head_macs, head_bytes, tuple(attention))


def _keys(span: RowSpan, window: int | None) -> tuple[int, int]:
    """(keys summed over the span's rows, distinct keys the span reads)."""
    first, last = span.start + 1, span.start + span.rows  # row i sees start + i + 1 keys
    seen = span.rows * (first + last) // 2
    if window is None or last <= window:
        return seen, last
    capped = sum(min(n, window) for n in range(first, last + 1))
    return capped, last - max(0, span.start + 1 - window)


def step_work(shape: ModelShape, spans: list[RowSpan]) -> StepWork:
    """The work of one step that computes ``spans``."""
    rows = sum(s.rows for s in spans)
    logit_rows = sum(s.logit_rows for s in spans)
    macs = kv = 0
    for heads, head_dim, window, token_bytes in shape.attention:
        for span in spans:
            seen, distinct = _keys(span, window)
            macs += seen * heads * head_dim * 2
            kv += distinct * token_bytes
    return StepWork(
        linear_macs=rows * shape.linear_macs_per_row,
        lm_head_macs=logit_rows * shape.lm_head_macs_per_row,
        attention_macs=macs,
        linear_bytes=shape.linear_bytes if rows else 0,
        lm_head_bytes=shape.lm_head_bytes if logit_rows else 0,
        kv_bytes=kv,
    )


def mean_work(works: list[StepWork]) -> StepWork:
    """The field-wise mean of several steps' work."""
    if not works:
        raise ConfigError("mean_work: no steps")
    n = len(works)
    fields = StepWork.__slots__
    return StepWork(**{f: sum(getattr(w, f) for w in works) / n for f in fields})


def floors(work: StepWork, rates: Rates) -> Floors:
    return Floors(
        linear=(work.linear_bytes / rates.read_bytes, work.linear_macs / rates.linear_macs),
        lm_head=(work.lm_head_bytes / rates.read_bytes, work.lm_head_macs / rates.lm_head_macs),
        attention=(work.kv_bytes / rates.read_bytes, work.attention_macs / rates.attention_macs),
    )


def _best_rate(amount: float, run, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return amount / best


def read_bandwidth(threads: int | None = None) -> float:
    """Bytes a second of summing a 1 GiB int64 buffer with torch at ``threads`` threads (None:
    the current count), best of 5."""
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        buf = torch.ones(1 << 27, dtype=torch.int64)
        return _best_rate(buf.numel() * 8, buf.sum, 5)
    finally:
        torch.set_num_threads(saved)


def attention_products(kv_dtype: torch.dtype) -> str:
    """What the compiled attention multiplies in for a cache of ``kv_dtype`` on this CPU at the
    kernels' current ISA: "bf16" (VDPBF16PS) or "fp32"."""
    if kv_dtype != torch.bfloat16 or not kernels.cpu_kernels_enabled():
        return "fp32"
    return "bf16" if attention_bf16_products() else "fp32"


def measure_rates(
    model: nn.Module, threads: int, rows: int = 256, kv_dtype: torch.dtype = torch.float32
) -> Rates:
    """This machine's rates at ``threads`` threads (best of several runs each): the read
    bandwidth, the model's largest linear layer and its LM head on ``rows`` rows, and the
    products attention takes over a ``kv_dtype`` cache (:func:`attention_products`)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        read = read_bandwidth()
        linears = [
            m
            for m in model.modules()
            if isinstance(m, QuantizableLinear) and not isinstance(m, ParallelLMHead)
        ]
        heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
        if not linears or not heads:
            raise ConfigError("step bounds: the model has no linear layer or no LM head")
        shapes = {m: _linear_shape(m) for m in (*linears, heads[0])}
        largest = max(linears, key=lambda m: shapes[m][0] * shapes[m][1])
        rates = []
        for linear in (largest, heads[0]):
            fan_in, out, _ = shapes[linear]
            x = torch.randn(rows, fan_in)
            with torch.no_grad():
                rates.append(_best_rate(rows * fan_in * out, partial(linear._matmul, x), 5))
        products = attention_products(kv_dtype)
        dtype = torch.bfloat16 if products == "bf16" else torch.float32
        a, b = torch.randn(512, 512).to(dtype), torch.randn(512, 512).to(dtype)
        attention = _best_rate(512**3 * 5, lambda: [torch.mm(a, b) for _ in range(5)], 10)
        return Rates(
            read_bytes=read,
            linear_macs=rates[0],
            lm_head_macs=rates[1],
            attention_macs=attention,
            attention_products=products,
        )
    finally:
        torch.set_num_threads(saved)
