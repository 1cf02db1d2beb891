"""Decodes beside long prefill chunks (issue 20, item 4): the prefill share policy off and on.

Replays one synthesized AgentX trace through the agentx engine in-process, once per
``--targets`` value (``SchedulerConfig.decode_step_target_ms``; 0 turns the policy off, so a
decode waits behind a whole 2,048-token chunk), and prints per run: TPGS, interactivity
P50/P90, TTFT P50/P90, wall time, engine steps and the step cost the adaptive model fitted.
The policy should raise interactivity at about the same TPGS. With ``--rounds N`` the targets
run N times, their order rotating each round so slow drift of the machine favours none.

    python benchmarks/prefill_share_bench.py                       # 0 (off) vs 200 ms
    python benchmarks/prefill_share_bench.py --targets 0,100,200,400 --rounds 2 --json out.json
    python benchmarks/prefill_share_bench.py --sessions 2 --scale 0.01 --max-think 0   # smoke

Timings mean something only on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import asdict, dataclass, replace

from agentx.bench import engines
from agentx.bench.agentx_adapter import AgentxAdapter, AgentxOptions
from agentx.bench.metrics import run_metrics
from agentx.bench.prompts import PromptBuilder
from agentx.bench.replay import ReplayConfig
from agentx.bench.sweep import run_point
from agentx.bench.synth import SynthConfig, synthesize
from agentx.bench.trace_stats import trace_stats


@dataclass(frozen=True, slots=True)
class ShareOptions(AgentxOptions):
    decode_step_target_ms: float = 0.0
    step_cost_model: str = "adaptive"

    def engine_config(self):
        config = AgentxOptions.engine_config(self)
        scheduler = replace(
            config.scheduler,
            decode_step_target_ms=self.decode_step_target_ms,
            step_cost_model=self.step_cost_model,
        )
        return replace(config, scheduler=scheduler)


class ShareAgentx(AgentxAdapter):
    """The in-process engine, reporting the step cost its scheduler ended with."""

    async def final_stats(self) -> dict | None:
        stats = await super().final_stats()
        if stats is not None:
            cost = self.engine.core.scheduler.cost_model.get_cost()
            stats["step_cost"] = asdict(cost)
        return stats


def run_one(args, trace, prompts, target_ms: float) -> dict:
    options = ShareOptions(
        model=args.model,
        threads=args.threads,
        kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_step_target_ms=target_ms,
        step_cost_model=args.step_cost_model,
    )
    config = ReplayConfig(args.concurrency, args.max_think, progress=not args.no_progress)
    result = asyncio.run(run_point(lambda: ShareAgentx(options), trace, config, prompts))
    metrics = run_metrics(result)
    stats = result.engine_stats or {}
    return {
        "decode_step_target_ms": target_ms,
        **{k: v for k, v in asdict(metrics).items() if k != "engine"},
        "num_steps": stats.get("num_steps"),
        "step_cost": stats.get("step_cost"),
    }


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    print(
        "| target ms | wall s | TPGS tok/s | interactivity P50 / P90 tok/s | "
        "TTFT P50 / P90 s | steps | fitted ms: base + token + request |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cost = r["step_cost"] or {}
        fitted = (
            f"{cost['base_ms']:.1f} + {cost['token_ms']:.3f} + {cost['request_ms']:.2f}"
            if cost
            else "-"
        )
        print(
            f"| {r['decode_step_target_ms']:g} | {r['wall_time']:.1f} | {r['tpgs']:,.0f} | "
            f"{_fmt(r['interactivity_p50'], '.2f')} / {_fmt(r['interactivity_p90'], '.2f')} | "
            f"{_fmt(r['ttft_p50'], '.2f')} / {_fmt(r['ttft_p90'], '.2f')} | "
            f"{r['num_steps']} | {fitted} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--scale", type=float, default=0.03)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-think", type=float, default=2.0, help="seconds (0: back to back)")
    parser.add_argument("--targets", default="0,200", help="decode_step_target_ms values, 0: off")
    parser.add_argument("--step-cost-model", default="adaptive", choices=("adaptive", "fixed"))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default SmolLM2)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", default=None, help="write the rows and the trace's stats here")
    args = parser.parse_args(argv)

    targets = [float(t) for t in args.targets.split(",") if t.strip()]
    trace = synthesize(
        SynthConfig(
            num_sessions=args.sessions,
            seed=args.seed,
            scale=args.scale,
            max_context_tokens=args.max_context,
        )
    )
    stats = trace_stats(trace)
    print(
        f"trace: {stats.num_sessions} sessions, {stats.num_requests} requests, "
        f"{stats.num_prompt_tokens} prompt tokens; concurrency {args.concurrency}",
        file=sys.stderr,
    )
    model = engines.resolve_model(args.model)
    prompts = PromptBuilder(trace.block_size, engines.token_space_for_model(model))
    rows = []
    for k in range(args.rounds):
        shift = k % len(targets)
        for target in targets[shift:] + targets[:shift]:
            print(f"[prefill share] decode_step_target_ms={target:g}", file=sys.stderr)
            rows.append(run_one(args, trace, prompts, target))
            print(json.dumps(rows[-1]), file=sys.stderr)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "trace": asdict(stats), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
