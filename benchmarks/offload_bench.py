"""Offload tiers on an AgentX-shaped trace whose working set is ~4x the device KV pool (issue 6).

Replays one synthesized trace through the agentx engine (in-process) with: device only,
+host, +host+disk, +host+disk+Mooncake, each with and without tool-latency hints (each turn
tells the engine how long its session's tool will take: the next turn's think time). Reports
prefix hit rate (vs the trace's theoretical rate), recomputed tokens, TPGS, TTFT P50/P90 and
the offload counters. Mooncake starts a local master, so run this inside a private network
namespace:

    unshare -n sh -c 'ip link set lo up && python benchmarks/offload_bench.py --json out.json'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from dataclasses import asdict, replace

from agentx.bench.adapter import GenerateRequest
from agentx.bench.agentx_adapter import AgentxAdapter, AgentxOptions
from agentx.bench.metrics import run_metrics
from agentx.bench.prompts import PromptBuilder, TokenSpace
from agentx.bench.replay import ReplayConfig
from agentx.bench.sweep import run_point
from agentx.bench.synth import SynthConfig, synthesize
from agentx.bench.trace import Trace, TraceRequest, group_steps
from agentx.bench.trace_stats import trace_stats
from agentx.config import OffloadConfig

PAGE_BYTES = 16 * 30 * 2 * 3 * 64 * 4  # SmolLM2 fp32, block 16


class HintedAgentx(AgentxAdapter):
    """The in-process agentx engine telling it how long each turn's tool will take."""

    def __init__(self, options: AgentxOptions, hints: dict[str, float]) -> None:
        super().__init__(options)
        self.hints = hints

    def hints_for(self, request: GenerateRequest) -> tuple:
        return tool_latency_hints(self.hints, request.request_id)


def tool_latency_hints(waits: dict[str, float], request_id: str) -> tuple:
    """``(ToolLatency(seconds),)`` for a request with a think time after it (next_think_times)."""
    from agentx.engine.hints import ToolLatency

    seconds = waits.get(request_id)
    return (ToolLatency(seconds),) if seconds else ()


def next_think_times(trace: Trace, max_think: float) -> dict[str, float]:
    """Request id (as the replay names them) -> the think time before its agent's next turn."""
    out: dict[str, float] = {}

    def walk(agent_id: str, steps) -> None:
        index = -1
        grouped = group_steps(steps)
        for k, step in enumerate(grouped):
            if isinstance(step, tuple):
                for sub in step:
                    walk(f"{agent_id}/{sub.agent_id}", sub.steps)
                continue
            index += 1
            following = grouped[k + 1] if k + 1 < len(grouped) else None
            if isinstance(following, TraceRequest) and following.think_time > 0:
                out[f"{agent_id}#{index}"] = min(following.think_time, max_think)

    for session in trace.sessions:
        walk(session.session_id, session.steps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--scale", type=float, default=0.03)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-think", type=float, default=3.0)
    parser.add_argument("--pool-ratio", type=float, default=4.0, help="working set / device pool")
    parser.add_argument("--configs", default="device,host,host+disk,host+disk+mooncake")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    trace = synthesize(
        SynthConfig(
            num_sessions=args.sessions, scale=args.scale, max_context_tokens=args.max_context
        )
    )
    stats = trace_stats(trace)
    # working set: every distinct block of content the trace ever sends
    distinct, largest = set(), 0
    for session, req in trace.iter_requests():
        distinct.update((session.scope, h) for h in req.hash_ids)
        largest = max(largest, req.num_input_tokens + req.num_output_tokens)
    working_set = len(distinct) * trace.block_size
    num_blocks = max(int(working_set / args.pool_ratio) // 16, largest // 16 + 16)
    # fp32 weights and KV, as PAGE_BYTES counts them (AgentxOptions' default is now "auto")
    options = AgentxOptions(
        threads=args.threads, quantization="none", kv_cache_bytes=num_blocks * PAGE_BYTES
    )
    hints = next_think_times(trace, args.max_think)
    prompts = PromptBuilder(trace.block_size, TokenSpace.default())
    disk = tempfile.mkdtemp(prefix="agentx-offload-bench-")
    tiers = {
        "device": OffloadConfig(),
        "host": OffloadConfig(host_bytes=4 * num_blocks * PAGE_BYTES),
        "host+disk": OffloadConfig(host_bytes=num_blocks * PAGE_BYTES, disk_path=disk),
        "host+disk+mooncake": OffloadConfig(
            host_bytes=num_blocks * PAGE_BYTES,
            disk_path=disk,
            mooncake="auto",
            mooncake_bytes=4 * num_blocks * PAGE_BYTES,
        ),
    }
    rows = []
    for name in args.configs.split(","):
        for with_hints in (False, True):
            if name == "device" and with_hints:
                continue  # hints act through the tiers
            tempdir = tempfile.mkdtemp(prefix="agentx-offload-disk-")
            offload = tiers[name]
            if offload.disk_path is not None:
                offload = replace(offload, disk_path=tempdir)  # every run starts cold
            factory = lambda o=offload, h=with_hints: HintedAgentx(  # noqa: E731
                replace(options, offload=o), hints if h else {}
            )
            config = ReplayConfig(args.concurrency, args.max_think, progress=True)
            result = asyncio.run(run_point(factory, trace, config, prompts))
            metrics = run_metrics(result)
            engine = result.engine_stats or {}
            row = {
                "tiers": name,
                "hints": with_hints,
                **{k: v for k, v in asdict(metrics).items() if k != "engine"},
                "offload_loaded_blocks": engine.get("offload_loaded_blocks"),
                "offload_prefetches": engine.get("offload_num_prefetches"),
            }
            rows.append(row)
            print(json.dumps(row))
    out = {
        "trace": {"sessions": args.sessions, "scale": args.scale, **asdict(stats)},
        "theoretical_hit_rate": stats.theoretical_hit_rate,
        "device_pool_blocks": num_blocks,
        "working_set_tokens": working_set,
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
