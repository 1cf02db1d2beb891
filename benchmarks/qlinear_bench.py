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
weights come from memory (and its threads, asleep by then, wake up). ``--layers N`` runs the
four layer projections of N layers, each its own random weights, in a decode step's order
(qkv, o, gate_up, down, then the next layer) at each M, and prints each shape's milliseconds
summed over the N layers (the best of --rounds passes): at N = 30 the weights (80 MB) cycle
through the caches as a step's do, with the threads kept awake between calls.

    python benchmarks/qlinear_bench.py --rows 8 --layers 30      # a decode step's GEMMs

Before/after comparisons run this file against another checkout's ``agentx``
(``PYTHONPATH=/path/to/other/checkout python benchmarks/qlinear_bench.py``), alternated.
"""

# ruff: noqa: E402 - OMP_WAIT_POLICY must be set before torch is imported

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
from collections.abc import Callable
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
    parser.add_argument(
        "--layers",
        type=int,
        default=0,
        help="the four layer projections of this many layers in a step's order (no LM head)",
    )
    args = parser.parse_args()
    if not cpu.available():
        raise SystemExit("the compiled CPU kernels are unavailable here")
    clock, rows = timing_setup(args)
    print(header(args.threads, cpu.get_isa()))
    if args.layers > 0:
        step_order(args.layers, rows, args.rounds, clock)
        return
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


def step_order(layers: int, rows: list[int], rounds: int, clock: Callable[[], float]) -> None:
    """--layers: each layer projection's time summed over `layers` layers run in step order."""
    op = torch.ops.agentx.quantized_linear
    gen = torch.Generator().manual_seed(1)
    shapes = SHAPES[:4]
    weights = []
    for _ in range(layers):
        for _name, bits, n, k in shapes:
            q, scale, mins = quant.quantize_weight(torch.randn(n, k, generator=gen), bits)
            weights.append((quant.pack_weight(q, scale, mins, bits), bits))
    print(f"ms summed over {layers} layers")
    print(f"| M | {' | '.join(name for name, *_ in shapes)} | all |")
    print("|---|" + "---|" * (len(shapes) + 1))
    for m in rows:
        xs = [torch.randn(m, k, generator=gen) for _name, _bits, _n, k in shapes]
        best = [float("inf")] * len(shapes)
        for _ in range(rounds + 1):  # the first pass warms up
            spent = [0.0] * len(shapes)
            for i, (packed, bits) in enumerate(weights):
                start = clock()
                op(xs[i % len(shapes)], *packed, None, bits)
                spent[i % len(shapes)] += clock() - start
            best = [min(b, s) for b, s in zip(best, spent, strict=True)]
        cells = " | ".join(f"{b * 1e3:.2f}" for b in best)
        print(f"| {m} | {cells} | {sum(best) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
