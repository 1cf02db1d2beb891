"""How a running request's KV blocks lie in the pool on real traffic: a trace replayed in-process,
the block table of every request the scheduler holds sampled every ``--every`` engine steps.

A decode step's attention reads each request's blocks in table order; neighbouring entries that
are neighbouring block ids (one pool row apart, in either direction) share 4 KiB pages and DRAM
rows, and the kernel reads them 10-18% faster than blocks in a random order of the pool
(``attention_kernel_bench.py --order runs random``). This prints the share of neighbouring
table entries whose ids differ by one, at each ``--kv-mb`` pool size (a small pool evicts and
reuses blocks, which is where a cache could scatter them), and the pool's evictions.

    python benchmarks/kv_block_runs.py docs/bench/saturation-2026-12-03/trace.jsonl
    python benchmarks/kv_block_runs.py TRACE --concurrency 16 --kv-mb 2048 400 200
"""

# ruff: noqa: E402 - OMP_WAIT_POLICY must be set before torch is imported

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import collections
import itertools

from agentx.bench.agentx_adapter import AgentxAdapter, AgentxOptions
from agentx.bench.loader import load_trace
from agentx.bench.replay import Replay, ReplayConfig
from agentx.engine import core

MIN_BLOCKS = 8  # tables shorter than this are left out (a short prompt says little)


def sample_tables(counts: collections.Counter, every: int) -> None:
    """Wrap ``EngineCore.step``: every ``every`` steps, each held request's table into counts."""
    step = core.EngineCore.step

    def sampled(self):
        out = step(self)
        counts["steps"] += 1
        if counts["steps"] % every == 0:
            kv = self.scheduler.kv
            for request_id in list(self.scheduler.requests):
                ids = kv.get_block_ids(request_id)[0]
                if len(ids) < MIN_BLOCKS:
                    continue
                counts["tables"] += 1
                counts["pairs"] += len(ids) - 1
                counts["adjacent"] += sum(1 for a, b in itertools.pairwise(ids) if abs(b - a) == 1)
        return out

    core.EngineCore.step = sampled


async def replay(path: str, concurrency: int, kv_mb: int, threads: int, every: int) -> dict:
    counts: collections.Counter = collections.Counter()
    step = core.EngineCore.step
    sample_tables(counts, every)
    adapter = AgentxAdapter(AgentxOptions(threads=threads, kv_cache_bytes=kv_mb << 20))
    try:
        info = await adapter.start()
        pool = adapter.engine.core.scheduler.kv.pool
        config = ReplayConfig(concurrency=concurrency, max_think=0, progress=False)
        await Replay(load_trace(path), adapter, config).run(info)
        evictions, blocks = pool.num_evictions, pool.num_blocks
    finally:
        await adapter.close()
        core.EngineCore.step = step
    return {**counts, "evictions": evictions, "blocks": blocks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kv-mb", type=int, nargs="*", default=[2048, 400, 200])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--every", type=int, default=20, help="sample every N engine steps")
    args = parser.parse_args()
    print(f"`{args.trace}`, concurrency {args.concurrency}, back to back")
    print("| KV pool MB | blocks | evictions | tables sampled | neighbouring entries adjacent |")
    print("|---|---|---|---|---|")
    for kv_mb in args.kv_mb:
        c = asyncio.run(replay(args.trace, args.concurrency, kv_mb, args.threads, args.every))
        share = c.get("adjacent", 0) / max(1, c.get("pairs", 0))
        print(
            f"| {kv_mb} | {c['blocks']} | {c['evictions']} | {c.get('tables', 0)} | "
            f"{share:.1%} ({c.get('adjacent', 0)} of {c.get('pairs', 0)}) |",
            flush=True,
        )


if __name__ == "__main__":
    main()
