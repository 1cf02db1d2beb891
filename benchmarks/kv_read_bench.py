"""A decode step's KV read alone: the blocks of 8 requests at 2K context in 30 layers' pools, read
in their tables' order with no arithmetic, beside a contiguous read of the same bytes.

A paged attention kernel reads each request's blocks wherever the cache put them (here in a
random order of the pool, as a cache that has run a while leaves them: the blocks of one layer
are ``--block-bytes`` apart in memory, 12,288 for SmolLM2's bf16 blocks of 16 tokens, 6,528 for
int8's), so this read is the memory bound such a kernel can reach on this machine, where
``step_profile.py``'s floor is a contiguous read (``torch.sum`` of 1 GiB). Each thread reads a
contiguous share of the block list, every 64-byte line of a block once, and prefetches the block
``--ahead`` places further (0: none). Prints GB/s, the best of --rounds.

    python benchmarks/kv_read_bench.py                          # bf16 blocks, 1 and 2 threads
    python benchmarks/kv_read_bench.py --block-bytes 6528 --ahead 0 1 2 4

The reader is compiled at first run (``torch.utils.cpp_extension``, about a minute).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

// Every 64-byte line of blocks order[0..n) (block_bytes each, block b at pool + b * block_bytes),
// `threads` threads a contiguous share of the list each; block i + ahead prefetched while block
// i is read.
int64_t read_blocks(torch::Tensor pool, torch::Tensor order, int64_t block_bytes, int64_t ahead,
                    int64_t threads) {
  const char* base = static_cast<const char*>(pool.data_ptr());
  const int64_t* o = order.data_ptr<int64_t>();
  const int64_t n = order.numel();
  int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int64_t id = omp_get_thread_num();
    const int64_t b0 = n * id / threads, b1 = n * (id + 1) / threads;
    __m256i acc = _mm256_setzero_si256();
    for (int64_t b = b0; b < b1; ++b) {
      const char* p = base + o[b] * block_bytes;
      const char* next = ahead > 0 && b + ahead < b1 ? base + o[b + ahead] * block_bytes : nullptr;
      for (int64_t off = 0; off + 64 <= block_bytes; off += 64) {
        if (next != nullptr) _mm_prefetch(next + off, _MM_HINT_T1);
        const __m256i* line = reinterpret_cast<const __m256i*>(p + off);
        acc = _mm256_add_epi32(acc, _mm256_loadu_si256(line));
        acc = _mm256_add_epi32(acc, _mm256_loadu_si256(line + 1));
      }
    }
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
    for (int32_t v : lanes) total += v;
  }
  return total;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--block-bytes", type=int, default=12288, help="a block of one layer")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--ahead", type=int, nargs="*", default=[0, 2])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    reader = load_inline(
        "agentx_kv_read_bench",
        cpp_sources=SOURCE,
        functions=["read_blocks"],
        extra_cflags=["-O2", "-mavx2", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
    blocks = args.requests * (args.context // 16 + 1) * args.layers
    pool = torch.randint(0, 100, (blocks * args.block_bytes // 4,), dtype=torch.int32)
    orders = {
        "random": torch.randperm(blocks, generator=torch.Generator().manual_seed(0)),
        "in order": torch.arange(blocks),
    }
    nbytes = blocks * (args.block_bytes // 64 * 64)
    print(f"{nbytes / 1e6:.0f} MB in {blocks} blocks of {args.block_bytes} bytes")
    print("| blocks | threads | ahead | GB/s | ms |")
    print("|---|---|---|---|---|")
    for name, order in orders.items():
        for threads in args.threads:
            for ahead in args.ahead:
                reader.read_blocks(pool, order, args.block_bytes, ahead, threads)
                best = float("inf")
                for _ in range(args.rounds):
                    start = time.perf_counter()
                    reader.read_blocks(pool, order, args.block_bytes, ahead, threads)
                    best = min(best, time.perf_counter() - start)
                print(
                    f"| {name} | {threads} | {ahead} | {nbytes / best / 1e9:.1f} | "
                    f"{best * 1e3:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
