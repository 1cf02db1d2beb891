"""First-turn lanes (issue 14, item 1): warm turns beside cold long first turns, lanes off and on.

Replays one mixed trace (``agentx/bench/mixed.py``: warm sessions taking turns on a cached
context while cold first turns of ``--cold-tokens`` arrive among them) through the agentx
engine in-process, once with one lane (``cold_prefill_tokens=0``) and once with first-turn
lanes (``cold_prefill_tokens=--cold-threshold``, ``cold_prefill_share=--share``), a fresh
engine each, and prints per run: warm-turn TTFT P50/P90, warm-turn interactivity P50/P90,
cold-turn TTFT P50/max, TPGS of the whole run and its wall time. Lanes should cut warm-turn
TTFT P90 at about the same TPGS. With ``--rounds N`` both settings run N times, their order
rotating each round so slow drift of the machine favours neither.

    python benchmarks/lanes_bench.py --json lanes.json                 # the default sizes
    python benchmarks/lanes_bench.py --cold-tokens 7680 --rounds 2     # longer cold prompts
    python benchmarks/lanes_bench.py --warm-sessions 2 --warm-turns 3 --cold-sessions 1 \\
        --system-tokens 512 --cold-tokens 2048 --cold-threshold 1024 --cold-delay 2 \\
        --warm-think 0.3                                               # smoke (about a minute)

Every prompt plus its output must fit the model's context (SmolLM2-135M: 8,192 tokens), so
``--cold-tokens`` is at most 8,192 minus ``--cold-output``. Timings mean something only on an
otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import asdict, replace

from agentx.bench import engines
from agentx.bench.agentx_adapter import AgentxAdapter, AgentxOptions
from agentx.bench.metrics import percentile, run_metrics
from agentx.bench.mixed import COLD, WARM, MixedConfig, mixed_trace, request_kind
from agentx.bench.prompts import PromptBuilder
from agentx.bench.records import RunResult
from agentx.bench.replay import ReplayConfig
from agentx.bench.sweep import run_point

MAX_MODEL_LEN = 8192  # SmolLM2-135M-Instruct's context; --max-model-len for other models


def run_one(args, trace, prompts, lanes: bool) -> dict:
    scheduler = {"cold_prefill_tokens": args.cold_threshold if lanes else 0}
    if lanes:
        scheduler["cold_prefill_share"] = args.share
    options = AgentxOptions(
        model=args.model,
        threads=args.threads,
        kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
        quantization=args.quantization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduler_options=scheduler,
    )
    num_sessions = len(trace.sessions)
    config = ReplayConfig(num_sessions, trace.meta["max_think"], progress=not args.no_progress)
    result = asyncio.run(run_point(lambda: AgentxAdapter(options), trace, config, prompts))
    requests = [
        {
            "id": r.request_id,
            "kind": request_kind(r),
            "submit": round(r.submit_time, 3),
            "ttft": None if r.ttft is None else round(r.ttft, 3),
            "end": round(r.end_time, 3),
            "cached": r.num_cached_tokens,
        }
        for r in result.records
    ]
    stats = result.engine_stats or {}
    row = {"lanes": lanes, **scheduler, **summarize(result), "num_steps": stats.get("num_steps")}
    return {**row, "requests": requests}


def summarize(result: RunResult) -> dict:
    """Warm-turn and cold-turn latency of one run, and the whole run's TPGS."""
    whole = run_metrics(result)
    warm = run_metrics(_only(result, WARM))
    cold = [r.ttft for r in result.records if request_kind(r) == COLD and r.ttft is not None]
    return {
        "wall_time": whole.wall_time,
        "tpgs": whole.tpgs,
        "num_failed": whole.num_failed,
        "num_warm_turns": warm.num_requests,
        "warm_ttft_p50": warm.ttft_p50,
        "warm_ttft_p90": warm.ttft_p90,
        "warm_interactivity_p50": warm.interactivity_p50,
        "warm_interactivity_p90": warm.interactivity_p90,
        "num_cold_turns": len(cold),
        "cold_ttft_p50": percentile(cold, 0.5),
        "cold_ttft_max": max(cold, default=None),
        "hit_rate": whole.achieved_hit_rate,
    }


def _only(result: RunResult, kind: str) -> RunResult:
    return replace(result, records=tuple(r for r in result.records if request_kind(r) == kind))


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    print(
        "| lanes | warm TTFT P50 / P90 s | warm interactivity P50 / P90 tok/s | "
        "cold TTFT P50 / max s | TPGS tok/s | wall s | failed |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        lanes = (
            f"on ({r['cold_prefill_tokens']}, {r['cold_prefill_share']:g})" if r["lanes"] else "off"
        )
        print(
            f"| {lanes} | {_fmt(r['warm_ttft_p50'], '.2f')} / {_fmt(r['warm_ttft_p90'], '.2f')} | "
            f"{_fmt(r['warm_interactivity_p50'], '.2f')} / "
            f"{_fmt(r['warm_interactivity_p90'], '.2f')} | "
            f"{_fmt(r['cold_ttft_p50'], '.2f')} / {_fmt(r['cold_ttft_max'], '.2f')} | "
            f"{r['tpgs']:,.0f} | {r['wall_time']:.1f} | {r['num_failed']} |"
        )


def build_parser() -> argparse.ArgumentParser:
    d = MixedConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warm-sessions", type=int, default=d.num_warm_sessions)
    p.add_argument("--warm-turns", type=int, default=d.warm_turns, help="after the warm-up")
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--task-tokens", type=int, default=d.task_tokens)
    p.add_argument("--warm-new", type=int, default=d.warm_new_tokens, help="tool result tokens")
    p.add_argument("--warm-output", type=int, default=d.warm_output_tokens)
    p.add_argument("--warm-think", type=float, default=d.warm_think_time, help="seconds")
    p.add_argument("--cold-sessions", type=int, default=d.num_cold_sessions)
    p.add_argument("--cold-tokens", type=int, default=d.cold_tokens)
    p.add_argument("--cold-output", type=int, default=d.cold_output_tokens)
    p.add_argument("--cold-delay", type=float, default=d.cold_delay, help="seconds")
    p.add_argument("--cold-interval", type=float, default=d.cold_interval, help="seconds")
    p.add_argument(
        "--cold-threshold",
        type=int,
        default=2048,
        help="cold_prefill_tokens with lanes on (default 2048, a step's budget: above a warm "
        "turn's and a warm-up's uncached tokens, below a cold turn's)",
    )
    p.add_argument("--share", type=float, default=0.25, help="cold_prefill_share with lanes on")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default SmolLM2)")
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument(
        "--quantization",
        default="auto",
        choices=("none", "auto", "int8", "int4"),
        help="auto (the engine's default: the GGUF's quantized weights) or none (fp32)",
    )
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--json",
        default=None,
        help="write the rows (with every request's times) and the trace here",
    )
    return p


def mixed_config(args: argparse.Namespace) -> MixedConfig:
    return MixedConfig(
        num_warm_sessions=args.warm_sessions,
        warm_turns=args.warm_turns,
        system_tokens=args.system_tokens,
        task_tokens=args.task_tokens,
        warm_new_tokens=args.warm_new,
        warm_output_tokens=args.warm_output,
        warm_think_time=args.warm_think,
        num_cold_sessions=args.cold_sessions,
        cold_tokens=args.cold_tokens,
        cold_output_tokens=args.cold_output,
        cold_delay=args.cold_delay,
        cold_interval=args.cold_interval,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mixed = mixed_config(args)
    mixed.check_fits(args.max_model_len)
    if args.cold_tokens <= args.cold_threshold:
        raise SystemExit(
            f"--cold-tokens {args.cold_tokens} must exceed --cold-threshold {args.cold_threshold}"
            " (or no turn joins the cold lane)"
        )
    trace = mixed_trace(mixed)
    trace = replace(trace, meta={**trace.meta, "max_think": mixed.max_think})
    print(
        f"trace {trace.trace_id}: {trace.num_requests} requests "
        f"({args.warm_sessions} x {args.warm_turns} warm turns, {args.cold_sessions} cold turns "
        f"of {args.cold_tokens} tokens)",
        file=sys.stderr,
    )
    model = engines.resolve_model(args.model)
    prompts = PromptBuilder(trace.block_size, engines.token_space_for_model(model))
    rows = []
    for k in range(args.rounds):
        for lanes in (False, True) if k % 2 == 0 else (True, False):
            print(f"[lanes] {'on' if lanes else 'off'}", file=sys.stderr)
            rows.append(run_one(args, trace, prompts, lanes))
            print(
                json.dumps({k: v for k, v in rows[-1].items() if k != "requests"}), file=sys.stderr
            )
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "trace": asdict(mixed), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
