"""Where a P/D hand-over starts paying off: a warm turn's new tokens prefilled on its D instance
vs on a P instance with its KV handed back to D (issue 14, item 2; ``DisaggConfig``).

For each N in --new-tokens, a session runs a cold --base-tokens turn, then a warm turn with N
new tokens, twice: on a coordinator whose threshold keeps every warm turn on D (local) and on
one whose threshold sends every warm turn through P (hand-over). Meanwhile --decodes other
requests decode on the same D instance (their stall is what a local prefill costs them). Per N
and path it prints the warm turn's TTFT, its total time, and the longest gap between two tokens
of the background decodes while the warm turn ran. The hand-over's fixed cost (export, the
tier, import) is the TTFT difference at small N.

On one machine P and D share the CPU cores, so a P prefill slows D's decodes too (on separate
devices it would not): this measures the hand-over cost and the local prefill time, not the
interference a real deployment avoids.

    python benchmarks/disagg_threshold.py                           # ~1 min on 2 cores
    python benchmarks/disagg_threshold.py --new-tokens 16 256 --decodes 0
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

from agentx import CacheConfig, EngineConfig, SamplingParams
from agentx.config import DisaggConfig, OffloadConfig, SpeculativeConfig
from agentx.engine.disagg import DisaggCoordinator


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def timed_turn(coordinator, prompt, session_id, max_tokens) -> tuple[float, float, list[int]]:
    start = time.perf_counter()
    stream = coordinator.add_request(prompt, greedy(max_tokens), session_id=session_id)
    ttft = None
    while not stream.finished:
        stream.get(timeout=600)
        ttft = ttft if ttft is not None else time.perf_counter() - start
    return ttft, time.perf_counter() - start, stream.token_ids


def background_gaps(coordinator, num, stop: threading.Event, gaps: list[float]) -> None:
    """``num`` requests decoding on D until ``stop``: record the longest inter-token gap."""
    streams = [coordinator.add_request([200 + i] * 20, greedy(4000)) for i in range(num)]
    last = time.perf_counter()
    worst = 0.0
    while not stop.is_set() and streams:
        streams[0].get(timeout=600)
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    for s in streams:
        coordinator.abort(s.request_id)
    gaps.append(worst)


def run(path: str, args, base: list[int]) -> list[tuple]:
    threshold = 1 << 30 if path == "local" else 0
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        config = EngineConfig(
            cache=CacheConfig(num_blocks=args.num_blocks),
            offload=OffloadConfig(disk_path=folder),
            speculative=SpeculativeConfig(enabled=False),
            num_threads=args.threads,
        )
        with DisaggCoordinator(config, DisaggConfig(local_prefill_tokens=threshold)) as pd:
            timed_turn(pd, list(range(1000, 1040)), "warm-up", 4)  # first forward of each
            for n in args.new_tokens:
                sid = f"s{n}"
                _, _, out = timed_turn(pd, base, sid, 4)
                prompt = base + out + [3000 + (i % 500) for i in range(n)]
                stop, gaps = threading.Event(), []
                bg = threading.Thread(target=background_gaps, args=(pd, args.decodes, stop, gaps))
                if args.decodes:
                    bg.start()
                    time.sleep(0.5)  # they are decoding
                ttft, total, _ = timed_turn(pd, prompt, sid, 4)
                stop.set()
                if args.decodes:
                    bg.join()
                pd.end_session(sid)
                rows.append((path, n, ttft, total, gaps[0] if gaps else float("nan")))
            pd.check_integrity()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--base-tokens", type=int, default=256)
    parser.add_argument("--decodes", type=int, default=2, help="background decodes on D")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per instance")
    parser.add_argument("--num-blocks", type=int, default=512)
    args = parser.parse_args()
    base = [100 + (i * 7) % 4000 for i in range(args.base_tokens)]
    rows = run("local", args, base) + run("hand-over", args, base)
    print(f"{'path':<10} {'new tok':>8} {'TTFT s':>8} {'total s':>8} {'bg max gap s':>13}")
    for path, n, ttft, total, gap in sorted(rows, key=lambda r: (r[1], r[0])):
        print(f"{path:<10} {n:>8} {ttft:>8.3f} {total:>8.3f} {gap:>13.3f}")


if __name__ == "__main__":
    main()
