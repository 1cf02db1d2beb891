"""Decode attention bandwidth on a GPU: the paged-attention kernel's bytes of K/V read per second,
as a share of the device's HBM peak (goal: at least 80% on long contexts).

Each case is a batch of decode rows (one query token per request) over contexts of one length,
bfloat16, block size 16, shuffled blocks. Bytes counted: the K and V each request reads (its
whole context) plus the queries and outputs; times are CUDA-event means over repeated launches
after a warm-up, so launch gaps are included (what a CUDA-graph decode step pays).

    python benchmarks/gpu/attention_bandwidth.py [--peak-tbps 4.8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from agentx.kernels import triton as tk

# (batch, context, query heads, KV heads, head dim): Llama-3-8B / 1B-like shapes
CASES = [
    (1, 32768, 32, 8, 128),
    (8, 8192, 32, 8, 128),
    (32, 4096, 32, 8, 128),
    (64, 4096, 32, 8, 64),
    (128, 2048, 32, 8, 128),
    (256, 1024, 32, 8, 128),
]
BLOCK_SIZE = 16


def run_case(batch, context, num_heads, num_kv_heads, head_dim, iters=50):
    blocks_per_req = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_req + 1
    dev = torch.device("cuda")
    cache = torch.randn(
        num_blocks, 2, BLOCK_SIZE, num_kv_heads, head_dim, dtype=torch.bfloat16, device=dev
    )
    perm = torch.randperm(num_blocks - 1, device=dev) + 1
    block_tables = perm.view(batch, blocks_per_req)
    q = torch.randn(batch, num_heads, head_dim, dtype=torch.bfloat16, device=dev)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)

    def launch():
        return tk.paged_attention_with_lse(
            q, cache, cu_q, lens, block_tables, scale=head_dim**-0.5,
            max_query_len=1, max_seq_len=context,
        )  # fmt: skip

    for _ in range(3):
        launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        launch()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / iters
    kv_bytes = batch * context * num_kv_heads * head_dim * 2 * 2  # K and V, bf16
    io_bytes = 2 * q.numel() * 2
    return seconds, (kv_bytes + io_bytes) / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="HBM peak (H200: 4.8 TB/s)")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args(argv)
    print(f"device: {torch.cuda.get_device_name()}  HBM peak taken as {args.peak_tbps} TB/s")
    print("| batch | context | heads (q/kv) | head dim | time (us) | TB/s | share of peak |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for case in CASES:
        seconds, bandwidth = run_case(*case)
        share = bandwidth / (args.peak_tbps * 1e12)
        b, ctx, h, hkv, d = case
        print(
            f"| {b} | {ctx} | {h}/{hkv} | {d} | {seconds * 1e6:.1f} | "
            f"{bandwidth / 1e12:.2f} | {share:.0%} |"
        )
        keys = ("batch", "context", "heads", "kv_heads", "head_dim")
        rows.append(dict(zip(keys, case, strict=True)))
        rows[-1].update(seconds=seconds, bytes_per_s=bandwidth, share_of_peak=share)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
