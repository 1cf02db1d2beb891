"""The K-quant linear kernel alone on Qwen2.5-Coder-1.5B's prefill shapes (GFLOP/s, ms a call).

One call is one layer's projection of M prompt rows through GGUF Q4_K / Q6_K super-blocks
(random bytes with small fp16 scales: the kernel's speed does not depend on the values). The
shapes are the model's (hidden 1536, intermediate 8960, 12 query and 2 KV heads of 128): qkv
(2048 x 1536), o (1536 x 1536), gate_up (17920 x 1536) and down (1536 x 8960, Q6_K and Q4_K as
Q4_K_M files mix them). Prints the best of --rounds timed calls; 2 M N K flops a call.

    python benchmarks/kquant_gemm_bench.py                       # M = 64, 256, 512, 2 threads
    python benchmarks/kquant_gemm_bench.py --rows 16,512 --threads 1
    python benchmarks/kquant_gemm_bench.py --threads 1 --cpu-time   # on a shared, loaded box
    python benchmarks/kquant_gemm_bench.py --isa avx512,amx          # ISAs side by side

Before/after comparisons run this file against another checkout's ``agentx``
(``PYTHONPATH=/path/to/other/checkout python benchmarks/kquant_gemm_bench.py``).
"""

# ruff: noqa: E402 - OMP_WAIT_POLICY must be set before torch is imported

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
from functools import partial

import torch

from agentx.bench.kernel_timing import add_timing_args, best_time, header, timing_setup
from agentx.kernels import cpu
from agentx.kernels.ref import kquant

SHAPES = (  # name, type, N, K
    ("qkv", kquant.Q4_K, 2048, 1536),
    ("o", kquant.Q4_K, 1536, 1536),
    ("gate_up", kquant.Q4_K, 17920, 1536),
    ("down", kquant.Q6_K, 1536, 8960),
    ("down", kquant.Q4_K, 1536, 8960),
)


def random_weight(n: int, k: int, kind: int) -> torch.Tensor:
    """Random super-blocks (N, K/256 * block bytes) whose fp16 scales are small and finite."""
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (n, k // kquant.BLOCK, kquant.block_bytes(kind)), generator=gen)
    raw = raw.to(torch.uint8)
    scales = (torch.rand(n, k // kquant.BLOCK, 2, generator=gen) * 0.02).half().view(torch.uint8)
    if kind == kquant.Q4_K:
        raw[..., 0:4] = scales
    else:
        raw[..., 208:210] = scales[..., :2]
    return raw.reshape(n, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_timing_args(parser, rows="64,256,512", rounds=5)
    parser.add_argument(
        "--isa", default=None, help="comma-separated kernel ISAs, timed in turn (default: the best)"
    )
    args = parser.parse_args()
    if not cpu.available():
        raise SystemExit("the compiled CPU kernels are unavailable here")
    clock, rows = timing_setup(args)
    isas = args.isa.split(",") if args.isa else [cpu.get_isa()]
    print(header(args.threads, ",".join(isas)))
    print("| shape | type | N x K | M | ISA | ms | GFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    op = torch.ops.agentx.kquant_linear
    gen = torch.Generator().manual_seed(1)
    for name, kind, n, k in SHAPES:
        w = random_weight(n, k, kind)
        type_name = "Q4_K" if kind == kquant.Q4_K else "Q6_K"
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            for isa in isas:
                with cpu.use_isa(isa):
                    best = best_time(partial(op, x, w, kind, None), args.rounds, clock)
                gflops = 2 * m * n * k / best / 1e9
                print(
                    f"| {name} | {type_name} | {n} x {k} | {m} | {isa} | {best * 1e3:.1f} "
                    f"| {gflops:.1f} |"
                )


if __name__ == "__main__":
    main()
