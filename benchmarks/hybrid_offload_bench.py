"""Offload tiers on a hybrid model (issue 38): prefix hit rate and recomputed tokens with tiers
against without, on multi-turn sessions whose working set is ~4x the device KV pool.

A tiny random Qwen3-Next (linear-attention checkpoints + full attention; the test suite's model,
so the numbers measure the cache, not the arithmetic) runs ``--sessions`` conversations of
``--turns`` turns round-robin, one request at a time: each turn re-sends its whole context plus
new tokens, as held KV of the session's previous turn. Every configuration must produce the same
greedy tokens (checked). Rows: device only, + host, + host + disk, each per retention policy.

    python benchmarks/hybrid_offload_bench.py [--sessions 8] [--turns 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tests.model_helpers import random_tokens, save_qwen3_next_folder, tiny_qwen3_next

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig
from agentx.config import OffloadConfig

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def make_turns(num_sessions: int, num_turns: int, first: int, step: int) -> list[list[list[int]]]:
    """Per session, the new tokens of each turn (the first turn's prompt, then user messages)."""
    return [
        [random_tokens(first if t == 0 else step, seed=1000 * s + t) for t in range(num_turns)]
        for s in range(num_sessions)
    ]


def run_config(folder: Path, turns, num_blocks: int, policy: str, offload: OffloadConfig) -> dict:
    cache = CacheConfig(
        block_size=16,
        num_blocks=num_blocks,
        retention_policy=policy,
        prefix_cache_retention_interval=32 if policy == "interval" else 0,
    )
    # 64-token chunks: interval retention takes a page per 32-token checkpoint during a chunk,
    # and a small pool must hold a whole chunk's pages at once
    sched = SchedulerConfig(max_num_batched_tokens=64)
    config = EngineConfig(model=str(folder), cache=cache, scheduler=sched, offload=offload)
    contexts = [[] for _ in turns]
    handles: list[str | None] = [None for _ in turns]
    outputs, num_prompt, num_cached, num_ideal = [], 0, 0, 0
    start = time.perf_counter()
    with Engine(config) as engine:
        block_size = engine.core.kv.block_size
        for t in range(len(turns[0])):
            for s, session in enumerate(turns):
                prompt = contexts[s] + session[t]
                stream = engine.add_request(prompt, GREEDY, hold_kv=True, held_kv=handles[s])
                gen = stream.result(timeout=600)
                if handles[s] is not None:
                    engine.release_held(handles[s])  # adopted, or released for room: a no-op
                handles[s] = stream.request_id
                outputs.append(gen.token_ids)
                num_prompt += len(prompt)
                num_cached += gen.usage.cached_tokens
                # the best any cache can do: the previous context's full blocks
                num_ideal += min(len(contexts[s]), len(prompt) - 1) // block_size * block_size
                contexts[s] = prompt + gen.token_ids
        engine.check_integrity()
        stats = engine.stats()
    return {
        "num_prompt_tokens": num_prompt,
        "num_cached_tokens": num_cached,
        "hit_rate": num_cached / num_prompt,
        "theoretical_hit_rate": num_ideal / num_prompt,
        "recomputed_tokens": num_prompt - num_cached,
        "offload_loaded_blocks": stats.offload_loaded_blocks,
        "offload_stored_blocks": stats.offload_stored_blocks,
        "seconds": round(time.perf_counter() - start, 1),
        "outputs": outputs,
        "block_size": block_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first", type=int, default=120, help="tokens of a session's 1st turn")
    parser.add_argument("--step", type=int, default=24, help="new tokens per later turn")
    parser.add_argument("--pool-ratio", type=float, default=4.0, help="working set / device pool")
    parser.add_argument("--policies", default="interval,marconi")
    parser.add_argument("--configs", default="device,host,host+disk")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="agentx-hybrid-offload-"))
    save_qwen3_next_folder(folder, tiny_qwen3_next())
    turns = make_turns(args.sessions, args.turns, args.first, args.step)
    gen_tokens = GREEDY.max_tokens * args.turns
    final = args.first + args.step * (args.turns - 1) + gen_tokens
    working_set = args.sessions * final  # tokens: every session's final context
    block_size = 32  # the tiny Qwen3-Next's linear state page raises the block size to 32
    num_groups = 3  # 2 linear-state groups + 1 full-attention group share the pool
    # the pool holds working_set / ratio tokens of the full-attention group (the linear groups
    # take one running page and some checkpoints per session on top, from the same pool)
    # (at least the largest turn: its full blocks plus running and checkpoint pages of a chunk;
    # a hybrid turn that cannot fit waits forever rather than failing: see the report)
    largest = -(-final // block_size) + 3 * (num_groups - 1) + 2
    num_blocks = max(int(working_set / args.pool_ratio / block_size) + 2 * num_groups, largest)
    page_bytes = 32768 * 2  # a generous bound on the tiny model's offload page
    tiers = {
        "device": OffloadConfig(),
        "host": OffloadConfig(host_bytes=8 * working_set // block_size * page_bytes),
        "host+disk": OffloadConfig(host_bytes=num_blocks * page_bytes),
    }
    rows, reference = [], None
    for policy in args.policies.split(","):
        for name in args.configs.split(","):
            offload = tiers[name]
            if name.endswith("disk"):
                offload = OffloadConfig(
                    host_bytes=offload.host_bytes,
                    disk_path=tempfile.mkdtemp(prefix="agentx-hybrid-disk-"),
                )
            row = run_config(folder, turns, num_blocks, policy, offload)
            outputs = row.pop("outputs")
            if reference is None:
                reference = outputs
            row["same_tokens"] = outputs == reference
            row = {"policy": policy, "tiers": name, **row}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {
        "sessions": args.sessions,
        "turns": args.turns,
        "working_set_tokens": working_set,
        "device_pool_blocks": num_blocks,
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
