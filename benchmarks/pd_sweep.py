"""The P/D sweep (issue 14, item 4): N workers as every xPyD split and as N colocated replicas,
each predicted from a saturation profile and measured on one trace.

For ``--workers N`` (default 2; each worker is one engine with ``--threads-per-worker`` torch
threads, default 1) the splits are::

    colocated        N replicas behind ReplicaRouter, sticky (dp_router_bench.py's "sticky"),
                     in this process, no shared tier
    xPyD             DisaggCoordinator with x prefill + y decode instances, x + y = N, x, y >= 1,
                     each a spawned process, KV handed over through a disk tier in a fresh
                     temporary folder (every instance writes the blocks it computes through)

1. Prediction (``--profile saturation.json`` from ``agentx bench saturate``, measured with the
   same threads per engine): ``predict_pd`` on the trace's demand (agentx/bench/pd_model.py),
   tokens/s per worker; without a profile the column says "-" (and the header says why).
2. Measurement: the trace is replayed through each split on fresh, cold workers (agentx.bench's
   replay; the metrics are ``run_metrics`` over the replay's own records, TPGS per worker).

It prints one table (split, predicted tok/s per worker, measured TPGS per worker, TTFT P50/P90,
interactivity P50/P90, hit rate achieved, failures, hand-overs / local prefills, wall time) and
the best split: the highest TPGS among the splits with no failure whose interactivity P90 is at
least ``--interactivity-floor`` (none, if no split reaches it). ``--out DIR`` gets
``pd_sweep.json`` (rewritten after every split), ``pd_sweep.md`` and ``pd_sweep.png``.

Not like for like: the colocated replicas are threads of this process (they share its GIL for
the Python side of their steps), the P/D instances are processes of their own that pay for a
disk tier's write-through and the hand-over; on one machine every worker shares the same cores
and memory bandwidth, so a split's isolation of prefill from decode cannot show as it would on
separate devices (docs/BENCHMARKS.md).

    python benchmarks/pd_sweep.py --profile sat/saturation.json --out pd/   # N=2, whole trace
    python benchmarks/pd_sweep.py --max-sessions 1 --max-think 0 --concurrency 1  # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

from dp_router_bench import DEFAULT_TRACE, RouterAdapter, RouterOptions, slice_trace

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
from agentx.bench.metrics import run_metrics
from agentx.bench.pd_model import SaturationProfile, trace_demand
from agentx.bench.pd_sweep import (
    COLOCATED,
    SWEEP_KIND,
    Prediction,
    Split,
    best_line,
    best_split,
    enumerate_splits,
    plot_rows,
    predict_splits,
    table,
)
from agentx.bench.prompts import PromptBuilder
from agentx.bench.replay import ReplayConfig
from agentx.bench.segments import prompt_token_ids
from agentx.bench.sweep import run_point
from agentx.bench.trace_stats import trace_stats
from agentx.errors import ConfigError


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    threads: int = 1  # per worker
    kv_cache_bytes: int = 1 << 30  # per worker
    max_num_batched_tokens: int = 2048
    dtype: str = "float32"
    local_prefill_tokens: int = 64  # DisaggConfig's: a warm turn with more new tokens goes to P
    parallel: dict = field(default_factory=dict)  # each worker's tp, dcp, pcp, ep (ParallelConfig)

    def router_options(self, num_workers: int) -> RouterOptions:
        return RouterOptions(
            dp=num_workers,
            threads=self.threads,
            kv_cache_bytes=self.kv_cache_bytes,
            max_num_batched_tokens=self.max_num_batched_tokens,
            dtype=self.dtype,
            parallel=dict(self.parallel),
        )


class PDAdapter(EngineAdapter):
    """A DisaggCoordinator (xPyD, a disk tier in a temporary folder) behind the replay's
    engine interface. The coordinator's calls cross pipes (a warm turn may wait for D's
    write-through stores): they run on worker threads, off the replay's event loop."""

    def __init__(self, split: Split, options: WorkerOptions) -> None:
        assert not split.colocated, split
        self.split, self.options = split, options
        self.name = split.name
        self.coordinator = None
        self._disk: tempfile.TemporaryDirectory | None = None

    def _build(self):
        from agentx import CacheConfig, EngineConfig, OffloadConfig, ParallelConfig, SchedulerConfig
        from agentx.config import DisaggConfig
        from agentx.engine.disagg import DisaggCoordinator

        o = self.options
        self._disk = tempfile.TemporaryDirectory(prefix="agentx-pd-sweep-")
        config = EngineConfig(
            dtype=o.dtype,
            num_threads=o.threads,
            cache=CacheConfig(kv_cache_bytes=o.kv_cache_bytes),
            scheduler=SchedulerConfig(max_num_batched_tokens=o.max_num_batched_tokens),
            offload=OffloadConfig(disk_path=self._disk.name),
            parallel=ParallelConfig(**o.parallel),
        )
        disagg = DisaggConfig(self.split.num_prefill, self.split.num_decode, o.local_prefill_tokens)
        return DisaggCoordinator(config, disagg)  # returns once every instance is warm

    async def start(self) -> EngineInfo:
        import anyio

        from agentx import __version__

        self.coordinator = await anyio.to_thread.run_sync(self._build)
        config = {**asdict(self.options), "split": self.split.name}
        return EngineInfo(self.name, __version__, config)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Tokens | Done]:
        import anyio

        from agentx import AgentXError, SamplingParams

        sampling = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        tokenizer = getattr(self.coordinator, "tokenizer", None)
        prompt = prompt_token_ids(request.prompt, tokenizer and tokenizer.encode)
        add = partial(self.coordinator.add_request, prompt, sampling,
                      session_id=request.session_id, request_id=request.request_id)  # fmt: skip
        try:
            stream = await anyio.to_thread.run_sync(add)
        except AgentXError as exc:
            raise BenchEngineError(str(exc)) from exc
        try:
            async for event in agentx_events(stream, request.return_ids):
                yield event
        finally:
            if not stream.finished:
                self.coordinator.abort(stream.request_id)

    async def end_session(self, session_id: str) -> None:
        import anyio

        await anyio.to_thread.run_sync(self.coordinator.end_session, session_id)

    async def final_stats(self) -> dict | None:
        import anyio

        if self.coordinator is None:
            return None
        coordinator = self.coordinator
        await anyio.to_thread.run_sync(coordinator.check_integrity)  # a leak fails the run
        stats = await anyio.to_thread.run_sync(coordinator.instance_stats)
        instances = {
            name: {**asdict(s), "prefix_cache_hit_rate": s.prefix_cache_hit_rate}
            for name, s in stats.items()
        }
        return {"instances": instances, "counters": asdict(coordinator.counters)}

    async def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()
            self.coordinator = None
        if self._disk is not None:
            self._disk.cleanup()
            self._disk = None


def make_adapter(split: Split, options: WorkerOptions) -> EngineAdapter:
    if split.colocated:
        adapter = RouterAdapter("sticky", options.router_options(split.num_workers))
        adapter.name = COLOCATED
        return adapter
    return PDAdapter(split, options)


# ---- the command ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    p.add_argument("--workers", type=int, default=2, help="N: engines per split")
    p.add_argument("--splits", default=None,
                   help="a subset, e.g. colocated,1P1D (default: every split of N)")  # fmt: skip
    p.add_argument("--profile", default=None, help="saturation.json for the predictions")
    p.add_argument("--profile-engine", default=None, help="its engine (when it holds several)")
    p.add_argument("--interactivity-floor", type=float, default=5.0, help="tok/s per request")
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="per worker")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--local-prefill-tokens", type=int, default=64, help="DisaggConfig's")
    p.add_argument("--dtype", default="float32")
    for degree in ("tp", "dcp", "pcp", "ep"):
        p.add_argument(
            f"--{degree}", type=int, default=1, help=f"each worker's ParallelConfig.{degree}"
        )
    p.add_argument("--concurrency", type=int, default=8, help="live session trees")
    p.add_argument("--max-think", type=float, default=2.0, help="cap on think time, seconds")
    p.add_argument("--max-sessions", type=int, default=None, help="replay the first N sessions")
    p.add_argument("--out", default=None, help="folder for pd_sweep.json / .md / .png")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        splits = enumerate_splits(args.workers)
    except ConfigError as exc:
        p.error(str(exc))
    if args.splits is not None:
        names = [s.strip() for s in args.splits.split(",") if s.strip()]
        known = {s.name: s for s in splits}
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            p.error(f"unknown splits {unknown} for {args.workers} workers; choose from "
                    f"{', '.join(known)}")  # fmt: skip
        splits = [s for s in splits if s.name in names]
    args.split_list = splits
    if args.interactivity_floor < 0:
        p.error(f"--interactivity-floor must be >= 0, got {args.interactivity_floor}")
    if args.max_sessions is not None and args.max_sessions <= 0:
        p.error(f"--max-sessions must be positive, got {args.max_sessions}")
    for name in ("threads_per_worker", "concurrency"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.max_think < 0:
        p.error(f"--max-think must be >= 0, got {args.max_think}")
    args.profile_obj = None
    if args.profile is not None:
        try:
            obj = json.loads(Path(args.profile).read_text())
            args.profile_obj = SaturationProfile.from_json(obj, args.profile_engine)
        except (OSError, ValueError, KeyError) as exc:
            p.error(f"--profile {args.profile}: {exc}")
    return args


def _header(args: argparse.Namespace, trace, stats: dict, command: str) -> str:
    if args.profile_obj is not None:
        about = f"`{args.profile}` (its floor {args.profile_obj.floor:g} tok/s)"
    else:
        about = "none given (--profile): no predictions"
    return (
        f"# P/D sweep\n\n- command: `{command}`\n- date: {time.strftime('%Y-%m-%d %H:%M')}\n"
        f"- trace: {trace.trace_id}, {stats['num_sessions']} sessions, "
        f"{stats['num_requests']} requests, {stats['num_prompt_tokens']} prompt tokens, "
        f"theoretical hit rate {stats['theoretical_hit_rate']:.1%}\n- workers: {args.workers} x "
        f"{args.threads_per_worker} thread(s), {args.kv_cache_gib:g} GiB KV each; concurrency "
        f"{args.concurrency}, max think {args.max_think:g} s\n- profile: {about}\n"
    )


def worker_options(args: argparse.Namespace) -> WorkerOptions:
    """Every worker's options from the command line (``--tp`` ... reach its ParallelConfig)."""
    return WorkerOptions(
        threads=args.threads_per_worker,
        kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        local_prefill_tokens=args.local_prefill_tokens,
        parallel={d: getattr(args, d) for d in ("tp", "dcp", "pcp", "ep") if getattr(args, d) != 1},
    )


def run_split(split: Split, options: WorkerOptions, trace, config, prompts):
    """One split on fresh workers: its metrics (TPGS per worker) and its engine stats."""
    factory = partial(make_adapter, split, options)
    result = asyncio.run(run_point(factory, trace, config, prompts))
    result = replace(result, num_devices=split.num_workers)
    return replace(run_metrics(result), engine=split.name), result.engine_stats


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trace = slice_trace(load_trace(args.trace), args.max_sessions)
    stats = trace_stats(trace).to_dict()
    options = worker_options(args)
    predictions: dict[str, Prediction] = {}
    if args.profile_obj is not None:
        try:
            predictions = predict_splits(args.profile_obj, trace_demand(trace), args.split_list)
        except ValueError as exc:  # no decode point of the profile reached its floor
            print(f"error: --profile {args.profile}: {exc}", file=sys.stderr)
            return 2
    command = " ".join(["python", *sys.argv]) if argv is None else " ".join(argv)
    header = _header(args, trace, stats, command)
    print(header, flush=True)
    prompts = PromptBuilder(trace.block_size, token_space_for_model(resolve_model(None)))
    config = ReplayConfig(args.concurrency, args.max_think, not args.no_progress)
    out_dir = Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    floor = args.interactivity_floor
    rows, runs = [], []
    for split in args.split_list:
        print(f"[pd-sweep] {split.name}", file=sys.stderr, flush=True)
        metrics, engine_stats = run_split(split, options, trace, config, prompts)
        rows.append((metrics, engine_stats))
        pred = predictions.get(split.name)
        runs.append({"split": split.name, "num_prefill": split.num_prefill,
                     "num_decode": split.num_decode, "prediction": pred and asdict(pred),
                     "metrics": metrics.to_json(), "engine_stats": engine_stats})  # fmt: skip
        if out_dir is not None:  # after every split: a crash loses the running one only
            best = best_split([m for m, _ in rows], floor)
            sweep = {"kind": SWEEP_KIND, "command": command, "trace": stats,
                     "num_workers": args.workers, "interactivity_floor": floor,
                     "profile": args.profile, "options": asdict(options), "runs": runs,
                     "best": best.engine if best else None}  # fmt: skip
            (out_dir / "pd_sweep.json").write_text(json.dumps(sweep, indent=1))
        if metrics.interrupted:
            break
    report = f"{table(rows, predictions)}\n\n{best_line([m for m, _ in rows], floor)}"
    print(report)
    if out_dir is not None:
        from agentx.bench.plots import plot_pd_sweep

        (out_dir / "pd_sweep.md").write_text(f"{header}\n{report}\n")
        plot_pd_sweep(plot_rows(runs), floor, out_dir / "pd_sweep.png")
    return 0 if all(m.num_failed == 0 and not m.interrupted for m, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
