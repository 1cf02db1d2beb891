"""Data-parallel replicas behind the session router on the AgentX trace (issue 12, part 6).

Replays one trace (default: the 2026-11-29 compare trace, 8 sessions, 103 requests) through
``ReplicaRouter`` with DP replicas in this process, once per routing policy, each run on fresh
cold replicas:

    sticky          a session stays on the replica that holds its KV; a first turn goes to the
                    replica the router sent the longest prefix of its prompt to (a subagent: its
                    parent's), within a load slack, else to the least loaded
    sticky-plain    sticky without the prefix index: every first turn to the least loaded
    sticky-migrate  sticky, and a waiting session whose home has more than --migrate-after live
                    requests more than the least-loaded replica moves there with its KV, through
                    a disk tier in a fresh temporary folder that every replica reads
    sticky-migrate-held
                    sticky-migrate, each agent's turn continuing the KV its previous turn held
                    (closed loop: a turn's prompt carries what the engine generated)
    sticky-migrate-toolwait
                    sticky-migrate-held, each turn carrying ToolLatency(the trace's think time
                    before its agent's next turn): a session whose home is overloaded when a
                    turn ends moves, held KV and all, while its tool runs (the router's
                    tool_wait_move_s, 1 s), not when its next turn comes
    round_robin     request i on replica i % dp (a session's KV is wherever its last turn ran)
    least_loaded    fewest live requests

and prints one row per policy: requests, achieved prefix hit rate vs the trace's theoretical
one (a single cache that saw every earlier request), recomputed tokens, TPGS (per replica:
each replica counts as a device), TTFT P50/P90, interactivity P90, requests per replica,
migrations (of them, during a tool wait), held tokens the migrations moved, the TTFT P50/P90
of the turns that came after their session moved, blocks the replicas loaded from the shared
tier instead of recomputing, and wall time. The metrics are agentx.bench's (``run_metrics``),
over the replay's own records. Only the sticky-migrate policies have a tier: their replicas
also write every block they compute through to disk (what having a shared tier costs), the
other policies keep KV on their replica only. ``--loop`` sets how the policies without held KV
replay (open by default, as recorded before); the held-KV ones always replay closed loop,
since held KV only continues a prompt that starts with the previous turn's prompt and output.

Threads: every replica runs with ``--threads-per-replica`` torch threads. The replicas live in
this process; ``torch.set_num_threads`` acts on the calling thread, and each replica's loop
thread runs with the count its replica set (the router's docstring), so DP=2 x 1 thread uses
the 2 cores of the reference machine; the loop threads share the GIL for the Python side of
their steps. Subagents are sessions of their own to the router; only their prompts (forked from
the parent's context) tell the prefix-aware sticky policy where their parent's KV is.

    python benchmarks/dp_router_bench.py                         # the whole trace, every policy
    python benchmarks/dp_router_bench.py --max-sessions 2 --max-think 0 --policies sticky
                                                                 # a smoke run
    python benchmarks/dp_router_bench.py --loop closed \
        --policies sticky-migrate,sticky-migrate-held,sticky-migrate-toolwait
                                                                 # moving at routing time vs
                                                                 # during the tool wait
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from offload_bench import next_think_times, tool_latency_hints

from agentx.bench.adapter import (
    BenchEngineError,
    Done,
    EngineAdapter,
    EngineInfo,
    GenerateRequest,
    Tokens,
    agentx_events,
)
from agentx.bench.engines import resolve_model, token_space_for_model
from agentx.bench.loader import load_trace
from agentx.bench.metrics import RunMetrics, percentile, run_metrics
from agentx.bench.prompts import PromptBuilder
from agentx.bench.records import RunResult
from agentx.bench.replay import ReplayConfig
from agentx.bench.segments import prompt_token_ids
from agentx.bench.sweep import run_point
from agentx.bench.trace import Trace
from agentx.bench.trace_stats import trace_stats

DEFAULT_TRACE = Path("docs/bench/compare-2026-11-29/trace.jsonl")
POLICIES = (
    "sticky",
    "sticky-plain",
    "sticky-migrate",
    "sticky-migrate-held",
    "sticky-migrate-toolwait",
    "round_robin",
    "least_loaded",
)
HELD_POLICIES = ("sticky-migrate-held", "sticky-migrate-toolwait")  # replayed closed loop


@dataclass(frozen=True, slots=True)
class RouterOptions:
    dp: int = 2
    threads: int = 1  # per replica
    kv_cache_bytes: int = 1 << 30  # per replica
    max_num_batched_tokens: int = 2048
    dtype: str = "float32"
    migrate_after: int = 2
    parallel: dict = field(default_factory=dict)  # each replica's tp, dcp, pcp, ep


class RouterAdapter(EngineAdapter):
    """A ReplicaRouter of in-process agentx replicas behind the replay's engine interface.

    A held-KV policy holds every turn's KV for its agent's next turn, as a Session would;
    ``tool_waits`` (request id -> seconds) become each turn's ToolLatency hint."""

    def __init__(
        self, policy: str, options: RouterOptions, tool_waits: dict[str, float] | None = None
    ) -> None:
        self.policy_name = policy
        self.options = options
        self.name = f"dp{options.dp}-{policy}"
        self.router = None
        self._disk: tempfile.TemporaryDirectory | None = None
        self.num_routed: Counter[int] = Counter()
        self.holds_kv = policy in HELD_POLICIES
        self.tool_waits = tool_waits or {}
        self._held: dict[str, str] = {}  # agent -> the handle of its last turn's KV
        self._num_moves: Counter[str] = Counter()  # agent -> migrations its turns have seen
        self.after_migration: list[str] = []  # the request ids that ran after a migration

    def _build(self):
        from agentx import CacheConfig, EngineConfig, OffloadConfig, ParallelConfig, SchedulerConfig
        from agentx.engine.router import ReplicaRouter, StickySessionPolicy

        o = self.options
        offload = OffloadConfig()
        policy = self.policy_name
        if policy.startswith("sticky-migrate"):
            self._disk = tempfile.TemporaryDirectory(prefix="agentx-dp-bench-")
            offload = OffloadConfig(disk_path=self._disk.name)
            policy = StickySessionPolicy(migrate_after=o.migrate_after)
        elif policy == "sticky-plain":
            policy = StickySessionPolicy(prefix_min_tokens=None)
        config = EngineConfig(
            dtype=o.dtype,
            num_threads=o.threads,
            cache=CacheConfig(kv_cache_bytes=o.kv_cache_bytes),
            scheduler=SchedulerConfig(max_num_batched_tokens=o.max_num_batched_tokens),
            offload=offload,
            parallel=ParallelConfig(dp=o.dp, **o.parallel),
        )
        return ReplicaRouter(config, policy)

    async def start(self) -> EngineInfo:
        import anyio

        from agentx import __version__

        self.router = await anyio.to_thread.run_sync(self._build)
        for engine in self.router.replicas:  # the warm-up forward is not part of the replay
            await anyio.to_thread.run_sync(engine.wait_ready)
        config = {**asdict(self.options), "policy": self.policy_name}
        return EngineInfo(self.name, __version__, config)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Tokens | Done]:
        from agentx import AgentXError, RequestOptions, SamplingParams

        sampling = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        options = RequestOptions(
            hold_kv=self.holds_kv,
            held_kv=self._held.pop(request.session_id, None),
            hints=self.hints_for(request),
        )
        try:
            replica, stream = self.router.route(
                prompt_token_ids(request.prompt, self.router.tokenizer.encode),
                sampling, session_id=request.session_id,
                request_id=request.request_id, options=options,
            )  # fmt: skip
        except AgentXError as exc:
            raise BenchEngineError(str(exc)) from exc
        self.num_routed[replica] += 1
        self._note_migration(request)
        try:
            async for event in agentx_events(stream, request.return_ids):
                if isinstance(event, Done) and self.holds_kv:
                    self._held[request.session_id] = stream.request_id
                yield event
        finally:
            if not stream.finished:
                self.router.replicas[replica].abort(stream.request_id)

    def hints_for(self, request: GenerateRequest) -> tuple:
        """ToolLatency(the think time before the agent's next turn), when there is one."""
        return tool_latency_hints(self.tool_waits, request.request_id)

    def _note_migration(self, request: GenerateRequest) -> None:
        """A request routed after its session moved (while it was routed, or during the tool
        wait before it, which routing waits for) counts as after a migration."""
        num = sum(m.session_id == request.session_id for m in self.router.migrations)
        if num > self._num_moves[request.session_id]:
            self._num_moves[request.session_id] = num
            self.after_migration.append(request.request_id)

    async def end_session(self, session_id: str) -> None:
        handle = self._held.pop(session_id, None)
        if handle is not None:  # before end_session: the router finds the replica by session
            self.router.release_held_soon(handle)
        self.router.end_session(session_id)

    async def final_stats(self) -> dict | None:
        if self.router is None:
            return None
        self.router.check_integrity()  # a leaked block fails the run, not just the table
        replicas = []
        for engine in self.router.replicas:
            stats = engine.stats()
            replicas.append({**asdict(stats), "prefix_cache_hit_rate": stats.prefix_cache_hit_rate})
        return {
            "replicas": replicas,
            "requests_per_replica": [self.num_routed[r] for r in range(len(replicas))],
            "num_migrations": len(self.router.migrations),
            "num_tool_wait_migrations": sum(m.during_tool_wait for m in self.router.migrations),
            "num_tier_loaded_blocks": sum(r["offload_loaded_blocks"] for r in replicas),
            "migrated_held_tokens": sum(m.num_held_tokens for m in self.router.migrations),
            "migrations": [asdict(m) for m in self.router.migrations],
            "after_migration": list(self.after_migration),
        }

    async def close(self) -> None:
        if self.router is not None:
            self.router.close()
            self.router = None
        if self._disk is not None:
            self._disk.cleanup()
            self._disk = None


def slice_trace(trace: Trace, max_sessions: int | None) -> Trace:
    if max_sessions is None:
        return trace
    return replace(trace, sessions=trace.sessions[:max_sessions])


def ttft_after_migration(result: RunResult) -> list[float | None]:
    """TTFT P50 and P90 of the requests that ran after their session moved."""
    after = set((result.engine_stats or {}).get("after_migration", ()))
    ttfts = [r.ttft for r in result.records if r.request_id in after and r.ttft is not None]
    return [percentile(ttfts, 0.5), percentile(ttfts, 0.9)]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[tuple[RunMetrics, dict]]) -> str:
    head = (
        "| policy | requests | failed | hit achieved | hit theoretical | recomputed tok | "
        "TPGS tok/s/replica | TTFT P50 s | TTFT P90 s | inter. P90 tok/s | "
        "requests per replica | migrations | during tool wait | held tok moved | "
        "TTFT after migration P50 / P90 s | blocks from tier | wall s |"
    )
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for m, stats in rows:
        moved_p50, moved_p90 = stats["ttft_after_migration"]
        lines.append(
            f"| {m.engine} | {m.num_requests} | {m.num_failed} | {_pct(m.achieved_hit_rate)} | "
            f"{_pct(m.theoretical_hit_rate)} | {m.num_recomputed_tokens} | {m.tpgs:.0f} | "
            f"{_num(m.ttft_p50, '.2f')} | {_num(m.ttft_p90, '.2f')} | "
            f"{_num(m.interactivity_p90, '.1f')} | "
            f"{' / '.join(map(str, stats['requests_per_replica']))} | "
            f"{stats['num_migrations']} | {stats['num_tool_wait_migrations']} | "
            f"{stats['migrated_held_tokens']} | "
            f"{_num(moved_p50, '.2f')} / {_num(moved_p90, '.2f')} | "
            f"{stats['num_tier_loaded_blocks']} | {m.wall_time:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    p.add_argument("--policies", default=",".join(POLICIES), help=f"of {', '.join(POLICIES)}")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--threads-per-replica", type=int, default=1)
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="per replica")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--migrate-after", type=int, default=2, help="sticky-migrate's threshold")
    p.add_argument("--concurrency", type=int, default=8, help="live session trees")
    p.add_argument("--max-think", type=float, default=2.0, help="cap on think time, seconds")
    p.add_argument("--loop", choices=("open", "closed"), default="open", help="held KV: closed")
    p.add_argument("--max-sessions", type=int, default=None, help="replay the first N sessions")
    p.add_argument("--json", default=None, help="write metrics and engine stats here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        p.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")

    trace = slice_trace(load_trace(args.trace), args.max_sessions)
    stats = trace_stats(trace).to_dict()
    options = RouterOptions(
        dp=args.dp,
        threads=args.threads_per_replica,
        kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        migrate_after=args.migrate_after,
    )
    prompts = PromptBuilder(trace.block_size, token_space_for_model(resolve_model(None)))
    config = ReplayConfig(args.concurrency, args.max_think, not args.no_progress, args.loop)
    tool_waits = next_think_times(trace, args.max_think)
    command = " ".join(["python", *sys.argv]) if argv is None else " ".join(argv)
    print(
        f"# DP router bench\n\n- command: `{command}`\n- date: {time.strftime('%Y-%m-%d %H:%M')}"
        f"\n- trace: {trace.trace_id}, {stats['num_sessions']} sessions, "
        f"{stats['num_requests']} requests, {stats['num_prompt_tokens']} prompt tokens, "
        f"theoretical hit rate {stats['theoretical_hit_rate']:.1%}\n- replicas: {args.dp} x "
        f"{args.threads_per_replica} thread(s), {args.kv_cache_gib:g} GiB KV each, "
        f"concurrency {args.concurrency}, max think {args.max_think:g} s, {args.loop} loop "
        f"(held-KV policies: closed)\n",
        flush=True,
    )
    rows, out = [], []
    for policy in policies:
        print(f"[bench] {policy}", file=sys.stderr, flush=True)
        waits = tool_waits if policy == "sticky-migrate-toolwait" else None
        factory = lambda p=policy, w=waits: RouterAdapter(p, options, w)  # noqa: E731
        loop = "closed" if policy in HELD_POLICIES else args.loop
        result = asyncio.run(run_point(factory, trace, replace(config, loop=loop), prompts))
        result = replace(result, num_devices=args.dp)
        metrics = replace(run_metrics(result), engine=policy)
        engine_stats = {**result.engine_stats, "ttft_after_migration": ttft_after_migration(result)}
        rows.append((metrics, engine_stats))
        out.append({"metrics": metrics.to_json(), "engine_stats": engine_stats, "loop": loop})
        if result.interrupted:
            break
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"trace": stats, "runs": out}, indent=1))
    return 0 if all(m.num_failed == 0 and not m.interrupted for m, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
