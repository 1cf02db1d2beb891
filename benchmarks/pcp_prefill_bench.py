"""One long prefill at prefill context parallel 2 vs world size 1 (and dcp=2 alone), on CPU.

Each configuration runs the model runner directly (no scheduler), one process per rank with one
torch thread each (gloo over loopback, as the engine's workers do): the prompt is prefilled in
``--chunk``-token steps into fresh blocks, ``--repeat`` times after a warm-up, and the median
wall time is reported. Under dcp / pcp every ``torch.distributed`` collective is timed on each
rank; "comm" is that time, waiting for the other rank included, as a share of the prefill.

    python benchmarks/pcp_prefill_bench.py                         # 2,048 tokens: 1, dcp2, pcp2
    python benchmarks/pcp_prefill_bench.py --tokens 2048 --chunk 512 --json out.json
    python benchmarks/pcp_prefill_bench.py --tokens 64 --repeat 1  # smoke

Timings mean something only on an otherwise idle machine with a core per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from agentx import env
from agentx.config import CacheConfig, EngineConfig, ParallelConfig
from agentx.engine.executors.worker import rank_state
from agentx.engine.models.loader import load_checkpoint
from agentx.engine.outputs import ScheduledRequest, SchedulerOutput
from agentx.engine.runner import ModelRunner
from agentx.engine.runner.model_runner import DTYPES
from agentx.engine.sampling import SamplingParams

MODES = {"1": ParallelConfig(), "dcp2": ParallelConfig(dcp=2), "pcp2": ParallelConfig(dcp=2, pcp=2)}
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass(frozen=True, slots=True)
class RankResult:
    rank: int
    times_s: list[float]  # per repeat: the whole prefill
    comm_s: list[float]  # per repeat: time inside collectives


def _config(args: argparse.Namespace, parallel: ParallelConfig) -> EngineConfig:
    num_blocks = -(-args.tokens // 16) + 2  # the null block and one spare
    return EngineConfig(
        model=args.model,
        num_threads=1,
        max_model_len=args.tokens + 16,
        cache=CacheConfig(num_blocks=num_blocks, block_size=16),
        parallel=parallel,
    )


def _steps(tokens: list[int], chunk: int, request_id: str) -> list[SchedulerOutput]:
    block_ids = list(range(1, 1 + -(-len(tokens) // 16)))
    steps = []
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        item = ScheduledRequest(
            request_id=request_id,
            token_ids=part,
            start_position=start,
            new_block_ids=(block_ids if start == 0 else [],),
            is_new=start == 0,
            sample=start + len(part) == len(tokens),
            sampling=_GREEDY,
            seed=0,
            num_output_tokens=0,
        )
        steps.append(SchedulerOutput([item], len(part), frozenset()))
    return steps


class _CommClock:
    """Wraps torch.distributed's collectives (looked up at call time by the model code)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("all_gather", "all_reduce"):
            setattr(torch.distributed, name, self._timed(getattr(torch.distributed, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def _run_rank(rank: int, world: int, args: argparse.Namespace, mode: str, port: int, queue):
    torch.set_num_threads(1)
    config = _config(args, MODES[mode])
    parallel = None
    if world > 1:
        env.pin_gloo_to_loopback()
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        parallel = rank_state(config, rank)
    checkpoint = load_checkpoint(config.model, DTYPES[config.dtype])
    extra = {} if parallel is None else {"parallel": parallel}
    runner = ModelRunner(config, checkpoint.spec, checkpoint.weights, **extra)
    runner.warm_up()
    clock = _CommClock() if world > 1 else None
    generator = torch.Generator().manual_seed(0)
    times, comms = [], []
    for i in range(args.repeat + 1):  # the first is a warm-up at the full length
        tokens = torch.randint(100, 40000, (args.tokens,), generator=generator).tolist()
        steps = _steps(tokens, args.chunk, f"prefill-{i}")
        if world > 1:
            torch.distributed.barrier()
            clock.seconds = 0.0
        start = time.perf_counter()
        for step in steps:
            runner.execute(step)
        elapsed = time.perf_counter() - start
        runner.forget(frozenset({f"prefill-{i}"}))
        if i:
            times.append(elapsed)
            comms.append(clock.seconds if clock else 0.0)
    queue.put(RankResult(rank, times, comms))
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    world = MODES[mode].world_size
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    procs = [
        context.Process(target=_run_rank, args=(r, world, args, mode, port, queue))
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    results = sorted((queue.get(timeout=args.timeout) for _ in procs), key=lambda r: r.rank)
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"{mode}: a rank exited with {proc.exitcode}")
    # a step ends when the slowest rank ends: per repeat the max over ranks
    times = [max(r.times_s[i] for r in results) for i in range(args.repeat)]
    median = statistics.median(times)
    comm = [statistics.median(r.comm_s) for r in results]
    return {
        "mode": mode,
        "world_size": world,
        "tokens": args.tokens,
        "chunk": args.chunk,
        "median_s": median,
        "tokens_per_s": args.tokens / median,
        "comm_s_per_rank": comm,
        "comm_share_per_rank": [c / median for c in comm],
        "times_s": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf or HF folder (default SmolLM2)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=None, help="tokens a step (default: all)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--modes", default="1,dcp2,pcp2", help=f"comma list of {list(MODES)}")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.chunk = args.chunk or args.tokens
    rows = [run_mode(args, mode) for mode in args.modes.split(",")]
    base = next((r["median_s"] for r in rows if r["mode"] == "1"), None)
    print(
        f"{args.tokens}-token prefill, {args.chunk}-token steps, one thread per rank, "
        f"median of {args.repeat} (cpu count {os.cpu_count()})"
    )
    print(f"{'mode':6} {'ranks':>5} {'time s':>8} {'tok/s':>8} {'vs 1':>6}  comm share per rank")
    for r in rows:
        speedup = f"{base / r['median_s']:.2f}x" if base else "-"
        share = (
            " ".join(f"{s:.0%}" for s in r["comm_share_per_rank"]) if r["world_size"] > 1 else "-"
        )
        print(
            f"{r['mode']:6} {r['world_size']:>5} {r['median_s']:>8.3f} "
            f"{r['tokens_per_s']:>8.1f} {speedup:>6}  {share}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
