"""The int4 / int8 linear kernel alone on SmolLM2-135M's shapes (GFLOP/s, ms a call).

One call is one layer's projection of M rows through group-wise packed weights (GGUF Q4_1 as
int4, Q8_0 as int8: `kernels/ref/quant.py`), random weights quantized once. The shapes are the
model's (hidden 576, intermediate 1536, 9 query and 3 KV heads of 64): qkv (960 x 576), o
(576 x 576), gate_up (3072 x 576), down (576 x 1536), and the tied LM head (49152 x 576, int8 as
the GGUF stores it). Prints the best of --rounds timed calls; 2 M N K flops a call.

    python benchmarks/qlinear_bench.py                          # M = 8, 64, 512, 2 threads
    python benchmarks/qlinear_bench.py --rows 6,512 --threads 1 --cpu-time

Before/after comparisons run this file against another checkout's ``agentx``
(``PYTHONPATH=/path/to/other/checkout python benchmarks/qlinear_bench.py``), alternated.
"""

# ruff: noqa: E402 - OMP_WAIT_POLICY must be set before torch is imported

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import platform
import subprocess
import time
from pathlib import Path

import torch

import agentx
from agentx.kernels import cpu
from agentx.kernels.ref import quant

# (name, bits, N, K)
SHAPES = (
    ("qkv", 4, 960, 576),
    ("o", 4, 576, 576),
    ("gate_up", 4, 3072, 576),
    ("down", 4, 576, 1536),
    ("lm_head", 8, 49152, 576),
)


def time_call(x: torch.Tensor, packed: tuple, bits: int, rounds: int, clock) -> float:
    op = torch.ops.agentx.quantized_linear
    op(x, *packed, None, bits)
    best = float("inf")
    for _ in range(rounds):
        start = clock()
        op(x, *packed, None, bits)
        best = min(best, clock() - start)
    return best


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def commit() -> str:
    root = Path(agentx.__file__).parent.parent
    out = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="8,64,512", help="comma-separated M values")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the calling thread's CPU seconds (with --threads 1: steadier on a loaded box)",
    )
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        raise SystemExit("--cpu-time measures the calling thread only: use it with --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    if not cpu.available():
        raise SystemExit("the compiled CPU kernels are unavailable here")
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(
        f"# {cpu_name()}, {os.cpu_count()} CPUs, {args.threads} threads, ISA {cpu.get_isa()}, "
        f"agentx {commit()} ({Path(agentx.__file__).parent}), torch {torch.__version__}"
    )
    print("| shape | bits | N x K | M | ms | GFLOP/s |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(1)
    for name, bits, n, k in SHAPES:
        q, scale, mins = quant.quantize_weight(torch.randn(n, k, generator=gen), bits)
        packed = quant.pack_weight(q, scale, mins, bits)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            best = time_call(x, packed, bits, args.rounds, clock)
            print(
                f"| {name} | {bits} | {n} x {k} | {m} | {best * 1e3:.2f} "
                f"| {2 * m * n * k / best / 1e9:.1f} |"
            )


if __name__ == "__main__":
    main()
