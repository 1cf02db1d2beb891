"""Engine benchmarks on CPU: prefill, single and batched decode, and a re-sent multi-turn chat.

Each benchmark is one function that takes a :class:`BenchContext` and returns :class:`Metric`
rows; ``main`` runs the chosen ones and prints a Markdown table headed by the exact command,
the machine and the date (``--json`` writes the same record to a file). Prompts are random
token ids from seeded generators, so two runs send the same prompts, and no benchmark ever hits
another's prefix cache. This file knows the engine only through its public API.

    python benchmarks/engine_bench.py                     # every benchmark (a few minutes)
    python benchmarks/engine_bench.py --quick             # smaller sizes: a smoke run
    python benchmarks/engine_bench.py --only decode_1 multiturn --json out.json
"""

# ruff: noqa: E402 - OMP_WAIT_POLICY must be set before torch is imported

from __future__ import annotations

import os

# Idle OpenMP threads that spin stall the engine thread's small matmuls on a busy CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import datetime
import json
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig

KV_CACHE_BYTES = 512 << 20  # ~11K tokens of SmolLM2-135M KV in fp32: every benchmark fits
FIRST_PLAIN_TOKEN_ID = 100  # SmolLM2's special tokens sit below this; prompts avoid them


@dataclass(frozen=True, slots=True)
class BenchSizes:
    prefill_prompt_size: int = 2048
    num_prefill_runs: int = 3  # after one warm-up run
    decode_prompt_size: int = 128
    decode_1_max_tokens: int = 128
    batch_max_tokens: int = 64
    num_turns: int = 12
    system_prompt_size: int = 512
    user_turn_size: int = 64
    turn_max_tokens: int = 32


FULL = BenchSizes()
QUICK = BenchSizes(
    prefill_prompt_size=256,
    num_prefill_runs=1,
    decode_prompt_size=32,
    decode_1_max_tokens=16,
    batch_max_tokens=8,
    num_turns=3,
    system_prompt_size=128,
    user_turn_size=16,
    turn_max_tokens=8,
)


class Metric(NamedTuple):
    name: str
    value: float | int | str
    unit: str


class BenchContext:
    """What every benchmark gets: sizes, the dtype, and one warm engine they share.

    The shared engine has prefix caching on; benchmarks that must not hit the cache send
    distinct random prompts. ``close()`` closes every engine built here.
    """

    def __init__(self, dtype: str, sizes: BenchSizes) -> None:
        self.dtype = dtype
        self.sizes = sizes
        self.failures: list[str] = []
        self._shared: Engine | None = None

    def engine_config(self, enable_prefix_caching: bool = True) -> EngineConfig:
        return EngineConfig(
            dtype=self.dtype,
            cache=CacheConfig(
                kv_cache_bytes=KV_CACHE_BYTES, enable_prefix_caching=enable_prefix_caching
            ),
            scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64),
        )

    def new_engine(self, enable_prefix_caching: bool = True) -> Engine:
        """A fresh engine, warmed up by one short request; the caller closes it."""
        engine = Engine(self.engine_config(enable_prefix_caching))
        warmup = random_prompts(engine, random.Random("warm-up"), 1, 32)
        engine.generate(warmup, SamplingParams(max_tokens=4, ignore_eos=True))
        return engine

    @property
    def shared_engine(self) -> Engine:
        if self._shared is None:
            self._shared = self.new_engine()
        return self._shared

    def fail(self, message: str) -> None:
        self.failures.append(message)
        print(f"\n!!!!!!!! FAIL: {message} !!!!!!!!\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()


def random_prompts(engine: Engine, rng: random.Random, num: int, size: int) -> list[list[int]]:
    vocab_size = engine.tokenizer.vocab_size
    return [
        [rng.randrange(FIRST_PLAIN_TOKEN_ID, vocab_size) for _ in range(size)] for _ in range(num)
    ]


# ---- streaming traces --------------------------------------------------------------------------


@dataclass(slots=True)
class Trace:
    """One streamed request: when each token arrived (perf_counter seconds) and what it was."""

    submitted: float
    times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    def decode_tokens_per_s(self) -> float:
        """From the first token to the last, so the prefill is excluded."""
        span = self.times[-1] - self.times[0]
        return (len(self.times) - 1) / span if span > 0 else float("nan")

    @property
    def ttft(self) -> float:
        return self.times[0] - self.submitted


async def _trace_one(
    engine: Engine, prompt: list[int], sampling: SamplingParams, submitted: float
) -> Trace:
    trace = Trace(submitted)
    async for out in engine.stream(prompt, sampling):
        now = time.perf_counter()
        trace.times.extend([now] * len(out.new_token_ids))
        trace.token_ids.extend(out.new_token_ids)
        trace.num_prompt_tokens = out.num_prompt_tokens
        trace.num_cached_tokens = out.num_cached_tokens
    return trace


def stream_all(
    engine: Engine, prompts: Sequence[list[int]], sampling: SamplingParams
) -> list[Trace]:
    """Submit every prompt at once and trace each, in prompt order."""

    async def run() -> list[Trace]:
        start = time.perf_counter()
        return list(
            await asyncio.gather(*(_trace_one(engine, p, sampling, start) for p in prompts))
        )

    return asyncio.run(run())


# ---- benchmarks --------------------------------------------------------------------------------


def bench_prefill(ctx: BenchContext) -> list[Metric]:
    """Prefill throughput and time to first token of one long, never-cached prompt."""
    size, engine = ctx.sizes.prefill_prompt_size, ctx.shared_engine
    prompts = random_prompts(engine, random.Random("prefill"), 1 + ctx.sizes.num_prefill_runs, size)
    ttfts = []
    for i, prompt in enumerate(prompts):
        [trace] = stream_all(engine, [prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        if trace.num_cached_tokens:
            ctx.fail(f"prefill run {i} hit the prefix cache ({trace.num_cached_tokens} tokens)")
        if i > 0:  # run 0 is the warm-up
            ttfts.append(trace.ttft)
    ttft = statistics.median(ttfts)
    return [
        Metric("prefill.prompt_tokens", size, "tok"),
        Metric("prefill.tokens_per_s", size / ttft, "tok/s"),
        Metric("prefill.ttft_median", ttft, "s"),
        Metric("prefill.ttft_min", min(ttfts), "s"),
        Metric("prefill.ttft_max", max(ttfts), "s"),
    ]


def bench_decode_1(ctx: BenchContext) -> list[Metric]:
    """Single-stream decode speed, timed from the first streamed token to the last."""
    engine, sizes = ctx.shared_engine, ctx.sizes
    [prompt] = random_prompts(engine, random.Random("decode_1"), 1, sizes.decode_prompt_size)
    sampling = SamplingParams(max_tokens=sizes.decode_1_max_tokens, ignore_eos=True)
    [trace] = stream_all(engine, [prompt], sampling)
    _check_lengths(ctx, "decode_1", [trace], sizes.decode_1_max_tokens)
    gaps_ms = sorted(1e3 * (b - a) for a, b in zip(trace.times, trace.times[1:], strict=False))
    return [
        Metric("decode_1.tokens_per_s", trace.decode_tokens_per_s(), "tok/s"),
        Metric("decode_1.inter_token_p50", statistics.median(gaps_ms), "ms"),
        Metric("decode_1.inter_token_p90", gaps_ms[int(0.9 * (len(gaps_ms) - 1))], "ms"),
        Metric("decode_1.inter_token_max", gaps_ms[-1], "ms"),
        Metric("decode_1.ttft", trace.ttft, "s"),
        Metric("decode_1.wall", trace.times[-1] - trace.submitted, "s"),
    ]


def _bench_batch(ctx: BenchContext, batch_size: int) -> list[Metric]:
    """Batched decode: distinct prompts submitted together.

    The steady phase runs from the moment every request has its first token to the last token;
    it counts only tokens that arrived inside it.
    """
    name, engine, sizes = f"decode_{batch_size}", ctx.shared_engine, ctx.sizes
    rng = random.Random(name)
    prompts = random_prompts(engine, rng, batch_size, sizes.decode_prompt_size)
    sampling = SamplingParams(max_tokens=sizes.batch_max_tokens, ignore_eos=True)
    traces = stream_all(engine, prompts, sampling)
    _check_lengths(ctx, name, traces, sizes.batch_max_tokens)
    start = traces[0].submitted
    all_started = max(t.times[0] for t in traces)
    end = max(t.times[-1] for t in traces)
    num_steady = sum(1 for t in traces for s in t.times if s > all_started)
    num_total = sum(len(t.times) for t in traces)
    steady_s = end - all_started
    return [
        Metric(f"{name}.steady_tokens_per_s", num_steady / steady_s if steady_s else 0.0, "tok/s"),
        Metric(f"{name}.steady_phase", steady_s, "s"),
        Metric(f"{name}.all_first_tokens", all_started - start, "s"),
        Metric(f"{name}.wall", end - start, "s"),
        Metric(f"{name}.wall_output_tokens_per_s", num_total / (end - start), "tok/s"),
    ]


def bench_decode_8(ctx: BenchContext) -> list[Metric]:
    return _bench_batch(ctx, 8)


def bench_decode_32(ctx: BenchContext) -> list[Metric]:
    return _bench_batch(ctx, 32)


def _check_lengths(ctx: BenchContext, name: str, traces: list[Trace], expected: int) -> None:
    lengths = sorted({len(t.token_ids) for t in traces})
    if lengths != [expected]:
        ctx.fail(f"{name}: expected {expected} output tokens per request, got {lengths}")


@dataclass(slots=True)
class Conversation:
    """One run of the re-sent conversation: per-turn traces and the wall time of all turns."""

    traces: list[Trace]
    wall_s: float

    @property
    def outputs(self) -> list[list[int]]:
        return [t.token_ids for t in self.traces]


def _run_conversation(
    engine: Engine, system: list[int], users: list[list[int]], max_tokens: int
) -> Conversation:
    """Turn i sends the whole history: previous prompt + previous output + the new user turn."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt, traces = list(system), []
    start = time.perf_counter()
    for i, user in enumerate(users):
        if i:
            prompt = prompt + traces[-1].token_ids + user
        traces += stream_all(engine, [prompt], sampling)
    return Conversation(traces, time.perf_counter() - start)


def bench_multiturn(ctx: BenchContext) -> list[Metric]:
    """A re-sent conversation with prefix caching on, then off; the outputs must be equal."""
    sizes, runs = ctx.sizes, {}
    for caching in (True, False):
        with ctx.new_engine(enable_prefix_caching=caching) as engine:
            rng = random.Random("multiturn")  # the same turns for both engines
            [system] = random_prompts(engine, rng, 1, sizes.system_prompt_size)
            users = random_prompts(engine, rng, sizes.num_turns, sizes.user_turn_size)
            runs[caching] = _run_conversation(engine, system, users, sizes.turn_max_tokens)
    on, off = runs[True], runs[False]
    _check_same_outputs(ctx, on, off)
    num_prompt = sum(t.num_prompt_tokens for t in on.traces)
    num_cached = sum(t.num_cached_tokens for t in on.traces)
    if any(t.num_cached_tokens for t in off.traces):
        ctx.fail("multiturn: the engine without prefix caching reported cached tokens")
    return [
        Metric("multiturn.turns", sizes.num_turns, ""),
        Metric("multiturn.wall_cache_on", on.wall_s, "s"),
        Metric("multiturn.wall_cache_off", off.wall_s, "s"),
        Metric("multiturn.speedup_off_over_on", off.wall_s / on.wall_s, "x"),
        Metric("multiturn.ttft_mean_cache_on", _mean_ttft(on), "s"),
        Metric("multiturn.ttft_mean_cache_off", _mean_ttft(off), "s"),
        Metric("multiturn.prompt_tokens", num_prompt, "tok"),
        Metric("multiturn.cached_tokens", num_cached, "tok"),
        Metric("multiturn.cached_fraction", 100 * num_cached / num_prompt, "%"),
        Metric("multiturn.outputs_identical", "yes" if on.outputs == off.outputs else "NO", ""),
    ]


def _mean_ttft(conv: Conversation) -> float:
    return statistics.fmean(t.ttft for t in conv.traces)


def _check_same_outputs(ctx: BenchContext, on: Conversation, off: Conversation) -> None:
    for turn, (a, b) in enumerate(zip(on.outputs, off.outputs, strict=True)):
        if a != b:
            index = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            ctx.fail(
                f"multiturn: prefix caching on and off diverge at turn {turn + 1}, output token "
                f"{index} (on: {a[index] if index is not None else a}, "
                f"off: {b[index] if index is not None else b})"
            )
            return


BENCHES: dict[str, Callable[[BenchContext], list[Metric]]] = {
    "prefill": bench_prefill,
    "decode_1": bench_decode_1,
    "decode_8": bench_decode_8,
    "decode_32": bench_decode_32,
    "multiturn": bench_multiturn,
}


# ---- report ------------------------------------------------------------------------------------


def machine_info(dtype: str) -> dict[str, object]:
    return {
        "cpu": _cpu_model(),
        "nproc": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "dtype": dtype,
        "python": platform.python_version(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_revision() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{rev}{' (uncommitted changes)' if dirty else ''}"


def _format_value(value: float | int | str) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return str(value)


def render_markdown(record: dict) -> str:
    m = record["machine"]
    lines = [
        "## agentx engine benchmark",
        "",
        f"- command: `{record['command']}`",
        f"- date: {record['date']}",
        f"- machine: {m['cpu']}, nproc {m['nproc']}, torch {m['torch']} "
        f"({m['torch_num_threads']} threads), dtype {m['dtype']}, Python {m['python']}, "
        f"OMP_WAIT_POLICY={m['omp_wait_policy']}, load average at start {m['loadavg_1m_at_start']}",
        f"- agentx: {record['git']}; benchmarks took {record['elapsed_s']:.0f} s",
        "",
        "| metric | value | unit |",
        "|---|---|---|",
    ]
    lines += [
        f"| {row['metric']} | {_format_value(row['value'])} | {row['unit']} |"
        for row in record["metrics"]
    ]
    for failure in record["failures"]:
        lines.append(f"\n**FAIL**: {failure}")
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run (< 1 min)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the record here")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(BENCHES),
        metavar="NAME",
        help=f"run only these benchmarks: {', '.join(BENCHES)}",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "benchmarks/engine_bench.py", *sys.argv[1:]])
    machine = machine_info(args.dtype)
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    ctx = BenchContext(args.dtype, QUICK if args.quick else FULL)
    metrics: list[Metric] = []
    start = time.perf_counter()
    try:
        for name in args.only or list(BENCHES):
            t0 = time.perf_counter()
            metrics += BENCHES[name](ctx)
            print(f"[{name}: {time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)
    finally:
        ctx.close()
    machine["torch_num_threads"] = torch.get_num_threads()  # the engine may have set it
    record = {
        "command": command,
        "date": date,
        "machine": machine,
        "git": _git_revision(),
        "sizes": asdict(ctx.sizes),
        "elapsed_s": time.perf_counter() - start,
        "metrics": [{"metric": m.name, "value": m.value, "unit": m.unit} for m in metrics],
        "failures": ctx.failures,
    }
    print(render_markdown(record))
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 1 if ctx.failures else 0


if __name__ == "__main__":
    sys.exit(main())
