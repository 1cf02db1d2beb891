"""The CPU paged attention kernel alone, with its KV coming from DRAM as in a real step.

One call is one layer's attention (SmolLM2's shapes: 9 query heads, 3 KV heads, head dim 64,
16-token blocks, bf16 KV). Every call reads another layer's pool (30 pools, as many as
SmolLM2's layers), so for contexts of 2K and more the working set is larger than L3 and each
call streams its KV from memory; the blocks of a request sit in a random order of its pool
(``--order random``, the default: the worst a cache that has run a while could leave them), in
one run of consecutive ids (``runs``: what a fresh pool hands out, and 78-91% of a running
request's neighbouring blocks on a trace, ``kv_block_runs.py``) or in one run backwards
(``descending``). Prints microseconds per call (the best of 5 rounds), milliseconds for 30
layers, and the KV bytes read per second.

    python benchmarks/attention_kernel_bench.py                 # decode rows and a prefill tile
    python benchmarks/attention_kernel_bench.py --threads 1 --context 2048 --requests 8
    python benchmarks/attention_kernel_bench.py --kv-dtype int8   # int8 KV (kernels/ref/kv_int8.py)
    python benchmarks/attention_kernel_bench.py --layers 1       # one pool: the kernel from cache
    python benchmarks/attention_kernel_bench.py --threads 2 --requests 8 --order random runs
"""

# ruff: noqa: E402 - OMP_WAIT_POLICY must be set before torch is imported

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import time

import torch

from agentx.engine.runner.kv_layout import allocate_zeroed
from agentx.kernels import cpu
from agentx.kernels.ref.kv_int8 import quantize_rows

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LAYERS = 30
CPU = torch.device("cpu")


def run(
    threads: int,
    context: int,
    requests: int,
    rows: int,
    kv_dtype: str,
    layers: int,
    order: str,
    huge_pages: bool = False,
) -> str:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    per_request = context // BLOCK + 1
    pools = []
    for _ in range(layers):
        pool = torch.randn(per_request * requests + 1, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
        pool = quantize_rows(pool) if kv_dtype == "int8" else pool.to(torch.bfloat16)
        if huge_pages:  # the engine's pool allocation (CacheConfig.huge_pages), then the values
            raw = allocate_zeroed(pool.shape[0], pool[0].numel() * pool.element_size(), CPU, True)
            pool = raw.view(pool.dtype).view(pool.shape).copy_(pool)
        pools.append(pool)
    ids = torch.randperm(per_request * requests, generator=g)  # drawn for every order: same q
    if order == "runs":  # each request's blocks consecutive, as a fresh pool hands them out
        ids = torch.arange(per_request * requests)
    if order == "descending":
        ids = torch.arange(per_request * requests).flip(0)
    tables = (ids + 1).view(requests, per_request)
    q = torch.randn(rows * requests, HEADS, HEAD_DIM, generator=g)
    token_req = torch.arange(requests).repeat_interleave(rows)
    token_len = torch.arange(context - rows + 1, context + 1, dtype=torch.long).repeat(requests)
    op = torch.ops.agentx.paged_attention_rows
    for i in range(layers):
        op(q, pools[i], tables, token_req, token_len, HEAD_DIM**-0.5, 0)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for i in range(3 * LAYERS):
            op(q, pools[i % layers], tables, token_req, token_len, HEAD_DIM**-0.5, 0)
        best = min(best, (time.perf_counter() - start) / (3 * LAYERS))
    kv_bytes = requests * context * 2 * pools[0][0, 0, 0].numel() * pools[0].element_size()
    return (
        f"| {kv_dtype} | {order} | {layers} | {threads} | {context} | {requests} | {rows} | "
        f"{best * 1e6:,.0f} | {best * LAYERS * 1e3:.2f} | {kv_bytes / best / 1e9:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--context", type=int, nargs="*", default=[2048])
    parser.add_argument("--requests", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--rows", type=int, default=1, help="query rows a request (1: decode)")
    parser.add_argument("--kv-dtype", nargs="*", default=["bfloat16"], choices=("bfloat16", "int8"))
    parser.add_argument(
        "--layers",
        type=int,
        default=LAYERS,
        help="pools the calls cycle through (1: one pool, read from cache)",
    )
    parser.add_argument(
        "--order",
        nargs="*",
        default=["random"],
        choices=("random", "runs", "descending"),
        help="each request's blocks: a random order of the pool, consecutive ids, or backwards",
    )
    parser.add_argument(
        "--huge-pages", action="store_true", help="the pools on transparent huge pages"
    )
    args = parser.parse_args()
    if not cpu.available():
        raise SystemExit("the CPU kernels are not built (python -m agentx.kernels.cpu)")
    print(
        "| KV | blocks | pools | threads | context | requests | rows each | us a call "
        "| ms for 30 layers | KV GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kv_dtype in args.kv_dtype:
        for threads in args.threads:
            for context in args.context:
                for requests in args.requests:
                    for order in args.order:
                        row = run(
                            threads,
                            context,
                            requests,
                            args.rows,
                            kv_dtype,
                            args.layers,
                            order,
                            args.huge_pages,
                        )
                        print(row, flush=True)


if __name__ == "__main__":
    main()
