"""The int4 / int8 linear kernel alone on SmolLM2-135M's shapes (GFLOP/s, ms a call).

One call is one layer's projection of M rows through group-wise packed weights (GGUF Q4_1 as
int4, Q8_0 as int8: `kernels/ref/quant.py`), random weights quantized once. The shapes are the
model's (hidden 576, intermediate 1536, 9 query and 3 KV heads of 64): qkv (960 x 576), o
(576 x 576), gate_up (3072 x 576), down (576 x 1536), and the tied LM head (49152 x 576, int8 as
the GGUF stores it). Prints the best of --rounds timed calls; 2 M N K flops a call.

    python benchmarks/qlinear_bench.py                          # M = 8, 64, 512, 2 threads
    python benchmarks/qlinear_bench.py --rows 6,512 --threads 1 --cpu-time
    python benchmarks/qlinear_bench.py --rows 1,8,16,64 --from-memory   # as in a decode step

``--from-memory`` reads 256 MB (more than any L3 here) before each timed call, so the call's
weights come from memory, as they do in a step that runs 30 layers' weights through the caches.

Before/after comparisons run this file against another checkout's ``agentx``
(``PYTHONPATH=/path/to/other/checkout python benchmarks/qlinear_bench.py``), alternated.
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
from agentx.kernels.ref import quant

# (name, bits, N, K)
SHAPES = (
    ("qkv", 4, 960, 576),
    ("o", 4, 576, 576),
    ("gate_up", 4, 3072, 576),
    ("down", 4, 576, 1536),
    ("lm_head", 8, 49152, 576),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_timing_args(parser, rows="8,64,512", rounds=7)
    parser.add_argument(
        "--from-memory",
        action="store_true",
        help="read 256 MB before each timed call: the weights come from memory, not the caches",
    )
    args = parser.parse_args()
    if not cpu.available():
        raise SystemExit("the compiled CPU kernels are unavailable here")
    clock, rows = timing_setup(args)
    print(header(args.threads, cpu.get_isa()))
    print("| shape | bits | N x K | M | ms | GFLOP/s |")
    print("|---|---|---|---|---|---|")
    op = torch.ops.agentx.quantized_linear
    gen = torch.Generator().manual_seed(1)
    evict = torch.ones(64 << 20).sum if args.from_memory else None  # 256 MB, read only
    for name, bits, n, k in SHAPES:
        q, scale, mins = quant.quantize_weight(torch.randn(n, k, generator=gen), bits)
        packed = quant.pack_weight(q, scale, mins, bits)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            best = best_time(partial(op, x, *packed, None, bits), args.rounds, clock, evict)
            print(
                f"| {name} | {bits} | {n} x {k} | {m} | {best * 1e3:.2f} "
                f"| {2 * m * n * k / best / 1e9:.1f} |"
            )


if __name__ == "__main__":
    main()
