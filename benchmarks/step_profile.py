"""Where an engine step's time goes: a decode step of 8 requests at 2K context, and a mixed step
(those 8 decodes beside a chunk of a new 2K prompt), for a configuration.

Every component is timed inside the engine's own loop (wrappers around the runner's calls;
the fused layer's stages by its opt-in C++ clock), averaged over the steps of each kind:

    GEMMs        linear layers (the fused layer's projections, or each layer's matmuls)
    attention    paged attention (+ RoPE and the KV write, which the fused layer does together)
    other ops    norms, activations, residual adds, embedding, final norm
    logits       the LM head over the sampling rows
    sampling     the sampler
    Python       everything else of `EngineCore.step`: scheduling, batch building, outputs

    python benchmarks/step_profile.py                    # the default configuration
    python benchmarks/step_profile.py --quantization none   # fp32, unfused (the old path)
    python benchmarks/step_profile.py --decoders 1          # one stream after a 2K prompt
    python benchmarks/step_profile.py --kv-cache-dtype int8 # int8 KV (bf16 by default)
    python benchmarks/step_profile.py --block-size 64       # 64-token KV blocks (16 by default)
    python benchmarks/step_profile.py --huge-pages          # the KV pool on transparent huge pages
    python benchmarks/step_profile.py --model qwen2.5-coder-1.5b --decoders 1 --context 128 \
        --threads 2                                       # single-stream decode, the coding model

It also prints the KV bytes a decode step reads (every decoder's context, every attention
layer, K and V, at the prompt's length) and what attention's time makes of them in GB/s, and
each kind of step's work beside its time: bytes and multiply-adds per component, with the
floors this machine's measured rates put under them (agentx/bench/step_bounds.py).
"""

# ruff: noqa: E402 - OMP_WAIT_POLICY must be set before torch is imported

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import collections
import dataclasses
import random
import time

import torch

from agentx import (
    CacheConfig,
    Engine,
    EngineConfig,
    SamplingParams,
    SchedulerConfig,
    SpeculativeConfig,
    kernels,
)
from agentx.bench import step_bounds
from agentx.bench.step_bounds import RowSpan
from agentx.engine import core
from agentx.engine.models import base, blocks, layers
from agentx.engine.runner import model_runner

CONTEXT = 2048
DECODERS = 8
VOCAB = 49152


class Clock:
    """Seconds per component in the current step, folded into per-kind totals at step end."""

    def __init__(self) -> None:
        self.step: collections.Counter[str] = collections.Counter()
        self.kinds: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.steps: collections.Counter[str] = collections.Counter()
        self.spans: dict[str, list[list[RowSpan]]] = collections.defaultdict(list)
        self.depth = 0

    def wrap(self, owner, name: str, component: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if self.depth:  # a timed call inside a timed call counts once, as the outer
                return inner(*args, **kwargs)
            self.depth += 1
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.step[component] += time.perf_counter() - start
                self.depth -= 1

        setattr(owner, name, timed)


def install(clock: Clock, fused_stages: list[torch.Tensor]) -> None:
    clock.wrap(layers.QuantizableLinear, "_matmul", "GEMMs")
    for name in ("paged_attention", "write_kv", "apply_rotary"):
        clock.wrap(kernels, name, "attention")
    for name in ("rms_norm", "silu_and_mul", "gelu_tanh_and_mul"):
        clock.wrap(kernels, name, "other ops")
    clock.wrap(base.CausalLM, "compute_logits", "logits")
    clock.wrap(model_runner, "sample", "sampling")

    def fused_timed(fused):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fused(*args, **kwargs)
            clock.step["fused layer"] += time.perf_counter() - start
            fused_stages.append(torch.ops.agentx.layer_stage_times(True))
            return out

        return timed

    # a layer at a time, or every layer in one call (blocks.FusedLayers): the stages add up
    blocks.kernels = _KernelsWith({name: fused_timed(getattr(kernels, name)) for name in FUSED_OPS})
    step = core.EngineCore.step

    def step_timed(self):
        clock.step.clear()
        start = time.perf_counter()
        scheduled = []
        schedule = self.scheduler.schedule

        def spy():
            out = schedule()
            scheduled.append(out)
            return out

        self.scheduler.schedule = spy
        try:
            return step(self)
        finally:
            del self.scheduler.schedule
            total = time.perf_counter() - start
            kind = _kind(scheduled)
            if kind is not None:
                stages = torch.stack(fused_stages).sum(0).tolist() if fused_stages else None
                _fold(clock, kind, total, stages)
                clock.spans[kind].append([_span(it) for it in scheduled[0].scheduled])
            fused_stages.clear()

    core.EngineCore.step = step_timed


FUSED_OPS = ("fused_decoder_layer", "fused_decoder_layers")


class _KernelsWith:
    """``agentx.kernels`` as blocks.py sees it, with the fused layer ops timed."""

    def __init__(self, timed: dict) -> None:
        self._timed = timed

    def __getattr__(self, name):
        if name in self._timed:
            return self._timed[name]
        return getattr(kernels, name)


def _kind(scheduled) -> str | None:
    if not scheduled or scheduled[0].is_empty:
        return None
    items = scheduled[0].scheduled
    decodes = sum(1 for it in items if len(it.token_ids) == 1)
    if decodes == DECODERS and len(items) == DECODERS:
        return "decode"
    if decodes == DECODERS and len(items) == DECODERS + 1:
        return "mixed"
    return None


def _span(item) -> RowSpan:
    logit_rows = (1 + item.num_draft_tokens if item.sample else 0) + len(item.prompt_targets)
    return RowSpan(item.start_position, len(item.token_ids), logit_rows)


def _fold(clock: Clock, kind: str, total: float, stages: list[int] | None) -> None:
    step = clock.step
    acc = clock.kinds[kind]
    if stages is not None:  # the fused layer's own clock: norms, GEMMs, rope+kv, attn, eltwise
        ns = sum(stages) or 1
        fused = step.pop("fused layer", 0.0)
        step["other ops"] += fused * (stages[0] + stages[4]) / ns
        step["GEMMs"] += fused * stages[1] / ns
        step["attention"] += fused * (stages[2] + stages[3]) / ns
    for component, seconds in step.items():
        acc[component] += seconds
    acc["total"] += total
    clock.steps[kind] += 1


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def main() -> None:
    global DECODERS, CONTEXT  # noqa: PLW0603 (read by _kind inside the engine's loop)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--decoders", type=int, default=8, help="requests decoding")
    parser.add_argument(
        "--speculative",
        choices=("on", "off"),
        default="off",
        help="drafting (off by default: a step of drafts is neither kind below)",
    )
    parser.add_argument("--kv-cache-dtype", default="auto", help="CacheConfig.kv_cache_dtype")
    parser.add_argument("--block-size", type=int, default=16, help="CacheConfig.block_size")
    parser.add_argument("--huge-pages", action="store_true", help="CacheConfig.huge_pages")
    parser.add_argument("--model", default=None, help="EngineConfig.model (default: embedded)")
    parser.add_argument("--context", type=int, default=CONTEXT, help="each prompt's tokens")
    parser.add_argument("--threads", type=int, default=None, help="EngineConfig.num_threads")
    parser.add_argument(
        "--small-step-tokens", type=int, default=None, help="EngineConfig.small_step_tokens"
    )
    args = parser.parse_args()
    DECODERS, CONTEXT = args.decoders, args.context
    model = {} if args.model is None else {"model": args.model}
    config = EngineConfig(
        **model,
        num_threads=args.threads,
        **({} if args.small_step_tokens is None else {"small_step_tokens": args.small_step_tokens}),
        quantization=args.quantization,
        cache=CacheConfig(
            kv_cache_bytes=1 << 30,
            kv_cache_dtype=args.kv_cache_dtype,
            block_size=args.block_size,
            huge_pages=args.huge_pages,
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=512),
        speculative=SpeculativeConfig(enabled=args.speculative == "on"),
    )
    clock = Clock()
    stages: list[torch.Tensor] = []
    with Engine(config) as engine:
        engine.wait_ready()
        caches = [c for c in engine.core.runner.kv_caches if isinstance(c, torch.Tensor)]
        # (num_blocks, 2, block_size, Hkv, row): a token's K and V in one layer
        token_bytes = sum(c[0, :, 0].numel() * c.element_size() for c in caches)
        kv_dtype = caches[0].dtype
        # the read rate before the steps too: other tenants' traffic moves it within minutes, and
        # the floor takes the better of the two (the machine's rate, not the minute's)
        read_before = step_bounds.read_bandwidth(engine.core.runner.num_threads)
        install(clock, stages)
        rng = random.Random(0)
        long = SamplingParams(max_tokens=10_000, ignore_eos=True)
        streams = [engine.add_request(_prompt(rng, CONTEXT), long) for _ in range(DECODERS)]
        for s in streams:  # every request prefilled and decoding
            s.get(timeout=600)
        time.sleep(1.0)  # decode steps only
        newcomer = engine.add_request(_prompt(rng, CONTEXT), SamplingParams(max_tokens=1))
        newcomer.result(timeout=600)  # mixed steps: its chunks beside the 8 decodes
        time.sleep(1.0)
        for s in streams:
            engine.abort(s.request_id)
        runner = engine.core.runner
        shape = step_bounds.model_shape(runner.model, runner.kv_caches)
        rates = step_bounds.measure_rates(runner.model, runner.num_threads, kv_dtype=kv_dtype)
    read_after = rates.read_bytes
    rates = dataclasses.replace(rates, read_bytes=max(read_before, read_after))
    print(
        f"{args.model or 'embedded model'}, quantization={args.quantization}, KV {kv_dtype}"
        f"{' on huge pages' if args.huge_pages else ''}, {DECODERS} request(s) at ~{CONTEXT} tokens"
    )
    kv_bytes = DECODERS * CONTEXT * token_bytes
    print(f"KV read per decode step: {kv_bytes / 1e6:.1f} MB ({token_bytes} B a token)")
    order = ["GEMMs", "attention", "other ops", "logits", "sampling", "Python"]
    print("| step | steps | total ms | " + " | ".join(order) + " |")
    print("|---|---|---|" + "---|" * len(order))
    for kind in ("decode", "mixed"):
        n = clock.steps[kind]
        if not n:
            continue
        acc = clock.kinds[kind]
        acc["Python"] = acc["total"] - sum(acc[c] for c in order if c != "Python")
        cells = " | ".join(f"{1e3 * acc[c] / n:.1f}" for c in order)
        print(f"| {kind} | {n} | {1e3 * acc['total'] / n:.1f} | {cells} |")
        if kind == "decode" and acc["attention"]:
            print(f"decode attention: {kv_bytes / (acc['attention'] / n) / 1e9:.1f} GB/s of KV")
    _print_bounds(clock, shape, rates, (read_before, read_after))


def _print_bounds(
    clock: Clock,
    shape: step_bounds.ModelShape,
    rates: step_bounds.Rates,
    reads: tuple[float, float],
) -> None:
    """Each kind of step's work and the floors under it, component by component; ``reads``: the
    read rates measured before and after the steps (``rates`` holds the better)."""
    print(
        f"\nrates: read {rates.read_bytes / 1e9:.1f} GB/s (torch sum of 1 GiB, the better of "
        f"before and after the steps: {reads[0] / 1e9:.1f} / {reads[1] / 1e9:.1f}); linear layers "
        f"{rates.linear_macs / 1e9:.1f} GMAC/s, LM head {rates.lm_head_macs / 1e9:.1f} GMAC/s "
        f"(the kernels on 256 rows); attention's {rates.attention_products} products "
        f"{rates.attention_macs / 1e9:.1f} GMAC/s (torch.mm 512^3)"
    )
    print(
        "| step | component | ms | MB read | GMAC | memory floor ms | compute floor ms | x floor |"
    )
    print("|---|---|---|---|---|---|---|---|")
    parts = (("GEMMs", "linear"), ("logits", "lm_head"), ("attention", "attention"))
    for kind in ("decode", "mixed"):
        n = clock.steps[kind]
        if not n:
            continue
        acc = clock.kinds[kind]
        work = step_bounds.mean_work([step_bounds.step_work(shape, s) for s in clock.spans[kind]])
        floor = step_bounds.floors(work, rates)
        sizes = {
            "linear": (work.linear_bytes, work.linear_macs),
            "lm_head": (work.lm_head_bytes, work.lm_head_macs),
            "attention": (work.kv_bytes, work.attention_macs),
        }
        for component, field in parts:
            memory, compute = getattr(floor, field)
            nbytes, macs = sizes[field]
            ms = 1e3 * acc[component] / n
            print(
                f"| {kind} | {component} | {ms:.1f} | {nbytes / 1e6:.0f} | {macs / 1e9:.2f} | "
                f"{1e3 * memory:.1f} | {1e3 * compute:.1f} | "
                f"{ms / (1e3 * max(memory, compute)):.1f}x |"
            )
        total = 1e3 * acc["total"] / n
        print(
            f"| {kind} | step | {total:.1f} | {work.bytes / 1e6:.0f} | "
            f"{(work.linear_macs + work.lm_head_macs + work.attention_macs) / 1e9:.2f} | "
            f"{1e3 * floor.memory:.1f} | {1e3 * floor.compute:.1f} | "
            f"{total / (1e3 * floor.memory):.1f}x memory, "
            f"{total / (1e3 * floor.compute):.1f}x compute |"
        )


if __name__ == "__main__":
    main()
