"""A decode step's KV read alone: the blocks of 8 requests at 2K context in 30 layers' pools, read
in their tables' order with no arithmetic, beside a contiguous read of the same bytes.

A paged attention kernel reads each request's blocks wherever the cache put them (here in a
random order of the pool, as a cache that has run a while leaves them: the blocks of one layer
are ``--block-bytes`` apart in memory, 12,288 for SmolLM2's bf16 blocks of 16 tokens, 6,528 for
int8's), so this read is the memory bound such a kernel can reach on this machine, where
``step_profile.py``'s floor is a contiguous read (``torch.sum`` of 1 GiB). Each thread reads a
contiguous share of the block list, every 64-byte line of a block once, and prefetches the block
``--ahead`` places further (0: none), a line beside each line it reads, with ``--hint`` (t1, the
attention kernel's, by default: into L2; t0, t2, nta; or "pages": only the first two lines of
each 4 KB page the block spans, for the hardware prefetcher to follow; "t1x2" / "t1x4": T1 on
every second / fourth line, for the L2's own prefetchers to fetch the rest). ``--within heads``
reads each block's lines in the attention kernel's order instead of the memory's: chunks of
``--chunk-blocks`` blocks (64 keys), in each one KV head at a time, its K rows of the chunk's
blocks, then its V rows (``--heads`` heads, each row's ``--head-bytes`` at its place in the
token's row), prefetching as ``lines`` does with t1, t1x2 or t1x4 (its other
hints are rows of ``lines`` only). ``--huge-pages`` puts the pool on transparent huge
pages (``CacheConfig.huge_pages``). Prints GB/s, the best of --rounds.

    python benchmarks/kv_read_bench.py                          # bf16 blocks, 1 and 2 threads
    python benchmarks/kv_read_bench.py --block-bytes 6528 --ahead 0 1 2 4
    python benchmarks/kv_read_bench.py --threads 2 --hint t1 t2 t0 nta pages --huge-pages
    python benchmarks/kv_read_bench.py --threads 2 --ahead 0 2 --within lines heads

The reader is compiled at first run (``torch.utils.cpp_extension``, about a minute).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.cpp_extension import load_inline

from agentx.engine.runner.kv_layout import allocate_zeroed

HINTS = {"t0": 0, "t1": 1, "t2": 2, "nta": 3, "pages": 4, "t1x2": 5, "t1x4": 6}

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

// Every 64-byte line of blocks order[0..n) (block_bytes each, block b at pool + b * block_bytes),
// `threads` threads a contiguous share of the list each; block i + ahead prefetched while block
// i is read: a line a line read with hint 0 (T0), 1 (T1), 2 (T2) or 3 (NTA); with hint 4 only
// the first two lines of each 4 KB page of it, at the block's start; with hint 5 (6) T1 on every
// second (fourth) line only, for the L2's own prefetchers to fetch the lines between.
int64_t read_blocks(torch::Tensor pool, torch::Tensor order, int64_t block_bytes, int64_t ahead,
                    int64_t threads, int64_t hint) {
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
      if (next != nullptr && hint == 4) {
        const uintptr_t end = reinterpret_cast<uintptr_t>(next) + block_bytes;
        for (uintptr_t q = reinterpret_cast<uintptr_t>(next); q < end;
             q = (q & ~uintptr_t{4095}) + 4096) {
          _mm_prefetch(reinterpret_cast<const char*>(q), _MM_HINT_T1);
          if (q + 64 < end) _mm_prefetch(reinterpret_cast<const char*>(q + 64), _MM_HINT_T1);
        }
        next = nullptr;
      }
      for (int64_t off = 0; off + 64 <= block_bytes; off += 64) {
        if (next != nullptr) {
          switch (hint) {
            case 0: _mm_prefetch(next + off, _MM_HINT_T0); break;
            case 2: _mm_prefetch(next + off, _MM_HINT_T2); break;
            case 3: _mm_prefetch(next + off, _MM_HINT_NTA); break;
            case 5: if (off % 128 == 0) _mm_prefetch(next + off, _MM_HINT_T1); break;
            case 6: if (off % 256 == 0) _mm_prefetch(next + off, _MM_HINT_T1); break;
            default: _mm_prefetch(next + off, _MM_HINT_T1);
          }
        }
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

// The same lines in the attention kernel's order: chunks of chunk_blocks blocks (a thread's
// share: whole chunks), in each chunk head h = 0 .. heads - 1: its K rows of the chunk's blocks
// (head_bytes at h * head_bytes of each of a block's rows, rows row_bytes apart; K the block's
// first half, V its second), then its V rows. While it reads, every line of the chunk `ahead`
// chunks on is prefetched (T1, or hint 5 / 6: every second / fourth line), spread evenly: as
// many lines a piece read as the piece has.
int64_t read_heads(torch::Tensor pool, torch::Tensor order, int64_t block_bytes, int64_t ahead,
                   int64_t threads, int64_t hint, int64_t chunk_blocks, int64_t heads,
                   int64_t head_bytes) {
  const char* base = static_cast<const char*>(pool.data_ptr());
  const int64_t* o = order.data_ptr<int64_t>();
  const int64_t chunks = order.numel() / chunk_blocks;
  const int64_t row_bytes = heads * head_bytes, half = block_bytes / 2;
  const int64_t rows = half / row_bytes, lines = block_bytes / 64;
  int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int64_t id = omp_get_thread_num();
    const int64_t c0 = chunks * id / threads, c1 = chunks * (id + 1) / threads;
    __m256i acc = _mm256_setzero_si256();
    int64_t fetch = (c0 + ahead) * chunk_blocks, fetch_line = 0;  // block, line in it
    const int64_t fetch_end = c1 * chunk_blocks;
    for (int64_t c = c0; c < c1; ++c) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t kv = 0; kv < 2; ++kv) {
          for (int64_t b = c * chunk_blocks; b < (c + 1) * chunk_blocks; ++b) {
            const char* p = base + o[b] * block_bytes + kv * half + h * head_bytes;
            for (int64_t r = 0; r < rows; ++r) {
              const char* row = p + r * row_bytes;
              for (int64_t off = 0; off + 32 <= head_bytes; off += 32) {
                const __m256i* piece = reinterpret_cast<const __m256i*>(row + off);
                acc = _mm256_add_epi32(acc, _mm256_loadu_si256(piece));
              }
              const int64_t piece_lines = ahead > 0 ? (head_bytes + 63) / 64 : 0;
              for (int64_t i = 0; i < piece_lines && fetch < fetch_end; ++i) {
                const int64_t every = hint == 6 ? 4 : hint == 5 ? 2 : 1;
                if (fetch_line % every == 0) {
                  _mm_prefetch(base + o[fetch] * block_bytes + 64 * fetch_line, _MM_HINT_T1);
                }
                if (++fetch_line == lines) {
                  fetch_line = 0;
                  ++fetch;
                }
              }
            }
          }
        }
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
    parser.add_argument("--hint", nargs="*", choices=list(HINTS), default=["t1"])
    parser.add_argument("--huge-pages", action="store_true", help="the pool on 2 MiB pages")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--within",
        nargs="*",
        choices=["lines", "heads"],
        default=["lines"],
        help="each block's lines in memory order, or in the attention kernel's (see above)",
    )
    parser.add_argument("--chunk-blocks", type=int, default=4, help="blocks a chunk (heads)")
    parser.add_argument("--heads", type=int, default=3, help="KV heads a token's row (heads)")
    parser.add_argument("--head-bytes", type=int, default=128, help="a head's bytes a row (heads)")
    args = parser.parse_args()
    blocks = args.requests * (args.context // 16 + 1) * args.layers
    if "heads" in args.within and (
        args.block_bytes % (2 * args.heads * args.head_bytes) or blocks % args.chunk_blocks
    ):
        parser.error("--within heads: a block's halves must be whole rows, the blocks whole chunks")
    reader = load_inline(
        "agentx_kv_read_bench",
        cpp_sources=SOURCE,
        functions=["read_blocks", "read_heads"],
        extra_cflags=["-O2", "-mavx2", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
    pool = allocate_zeroed(blocks, args.block_bytes, torch.device("cpu"), args.huge_pages)
    pool.view(torch.int32).copy_(torch.randint(0, 100, (blocks, args.block_bytes // 4)))
    orders = {
        "random": torch.randperm(blocks, generator=torch.Generator().manual_seed(0)),
        "in order": torch.arange(blocks),
    }
    nbytes = blocks * (args.block_bytes // 64 * 64)
    pages = " on huge pages" if args.huge_pages else ""
    print(f"{nbytes / 1e6:.0f} MB in {blocks} blocks of {args.block_bytes} bytes{pages}")
    shape = (args.chunk_blocks, args.heads, args.head_bytes)
    print("| blocks | within | threads | ahead | hint | GB/s | ms |")
    print("|---|---|---|---|---|---|---|")
    for name, order in orders.items():
        for threads in args.threads:
            for ahead in args.ahead:
                for hint in args.hint if ahead > 0 else ["-"]:
                    for within in args.within:
                        run = (pool, order, args.block_bytes, ahead, threads, HINTS.get(hint, 1))
                        if within == "heads" and hint in ("t1", "t1x2", "t1x4", "-"):
                            read = lambda run=run: reader.read_heads(*run, *shape)  # noqa: E731
                        elif within == "heads":  # its prefetch takes T1 and its thinnings only
                            continue
                        else:
                            read = lambda run=run: reader.read_blocks(*run)  # noqa: E731
                        read()
                        best = float("inf")
                        for _ in range(args.rounds):
                            start = time.perf_counter()
                            read()
                            best = min(best, time.perf_counter() - start)
                        print(
                            f"| {name} | {within} | {threads} | {ahead} | {hint} | "
                            f"{nbytes / best / 1e9:.1f} | {best * 1e3:.1f} |",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
