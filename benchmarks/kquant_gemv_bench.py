"""K-quant decode GEMV: time and effective weight bandwidth of the compiled K-quant kernel
(``torch.ops.agentx.kquant_linear``) on Qwen2.5-Coder-1.5B's linear shapes at a few rows.

Random weight bytes (the kernel's cost does not depend on their values), the same layouts as
the GGUF file: Q4_K (type 12) or Q6_K (type 14) super-blocks. GB/s = weight bytes / time (the
activations are tiny next to the weight). Median and best of ``--reps`` calls after a warm-up
(on a shared, loaded machine the best is the steadier of the two).

    python benchmarks/kquant_gemv_bench.py                       # 2 threads, M = 1, 2, 4
    python benchmarks/kquant_gemv_bench.py --threads 1 --rows 1  # one thread, decode only
    python benchmarks/kquant_gemv_bench.py --bandwidth           # + a 1 GiB read (torch)

Run it against another checkout (``PYTHONPATH=/path/to/checkout``) for a before/after.
"""

# ruff: noqa: E402 - OMP_WAIT_POLICY must be set before torch is imported

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import platform
import statistics
import time

import torch

from agentx.bench.step_bounds import read_bandwidth
from agentx.kernels import cpu
from agentx.kernels.ref import kquant

# (name, N, K, type): Qwen2.5-Coder-1.5B-Instruct Q4_K_M's per-layer projections and LM head
SHAPES = (
    ("qkv", 2048, 1536, kquant.Q4_K),
    ("o", 1536, 1536, kquant.Q4_K),
    ("gate_up", 17920, 1536, kquant.Q4_K),
    ("down", 1536, 8960, kquant.Q6_K),
    ("lm_head", 151936, 1536, kquant.Q6_K),
)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def weight(n: int, k: int, kind: int) -> torch.Tensor:
    """Random super-block bytes with finite small fp16 scales (any bytes multiply the same)."""
    gen = torch.Generator().manual_seed(n + k)
    raw = torch.randint(0, 256, (n, k // kquant.BLOCK, kquant.block_bytes(kind)), generator=gen)
    raw = raw.to(torch.uint8)
    scales = (torch.rand(n, k // kquant.BLOCK, 1, generator=gen) * 0.02).half().view(torch.uint8)
    if kind == kquant.Q4_K:
        raw[..., 0:2], raw[..., 2:4] = scales, scales
    else:
        raw[..., 208:210] = scales
    return raw.reshape(n, -1)


def time_call(x: torch.Tensor, w: torch.Tensor, kind: int, reps: int) -> tuple[float, float]:
    torch.ops.agentx.kquant_linear(x, w, kind, None)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        torch.ops.agentx.kquant_linear(x, w, kind, None)
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--only", nargs="+", help="shape names (qkv o gate_up down lm_head)")
    parser.add_argument("--bandwidth", action="store_true", help="also time a 1 GiB read")
    args = parser.parse_args()
    if not cpu.available():
        raise SystemExit("the compiled CPU kernels are unavailable here")
    torch.set_num_threads(args.threads)
    print(
        f"# kquant_gemv_bench: {cpu_name()}, {args.threads} threads, ISA {cpu.get_isa()}, "
        f"load average {os.getloadavg()[0]:.1f}, agentx from {os.path.dirname(cpu.__file__)}"
    )
    if args.bandwidth:
        print(f"# read bandwidth (torch sum of 1 GiB): {read_bandwidth() / 1e9:.1f} GB/s")
    print("| shape | type | N x K | MB | M | ms median | ms best | GB/s best |")
    print("|---|---|---|---|---|---|---|---|")
    for name, n, k, kind in SHAPES:
        if args.only and name not in args.only:
            continue
        w = weight(n, k, kind)
        mb = w.numel() / 1e6
        for m in args.rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            reps = max(3, args.reps // 4) if name == "lm_head" else args.reps
            med, best = time_call(x, w, kind, reps)
            label = "Q4_K" if kind == kquant.Q4_K else "Q6_K"
            print(
                f"| {name} | {label} | {n} x {k} | {mb:.1f} | {m} | {med * 1e3:.3f} | "
                f"{best * 1e3:.3f} | {mb / 1e3 / best:.1f} |"
            )


if __name__ == "__main__":
    main()
