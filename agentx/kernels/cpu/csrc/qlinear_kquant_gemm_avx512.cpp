// The K-quant GEMM (qlinear_kquant_gemm.cpp) for AVX-512 VNNI CPUs: 16 columns a zmm register
// and vpdpbusd, 4 byte products added into each column's own int32 lane.
//
// Each thread takes tiles of kTileCols (48) output columns; for each super-block b it unpacks
// the tile's weights once into an L1-resident Tile (one byte a weight, 16 columns interleaved in
// the int32 lanes of a zmm) and runs up to 256 rows against it, 4 rows x the tile's 48
// columns of accumulators at a time:
//
//   for tile of 48 columns:             (threads split the tiles)
//     for rows m0 .. m0 + 256:
//       for b in super-blocks:          (in order: the float steps fold block after block,
//                                        block 0's onto 0.f)
//         unpack tile's block b         -> Tile
//         for rows r0, r0 + 4, ...:     exact int32 sums of 4 rows x 48 columns, then
//           y[r, c] = y[r, c] + step(...)    (kquant.h's roundings, 16 columns a vector)
//
// A step is one vpdpbusd of 16 columns x 4 weights (unsigned bytes) against a row's 4 int8
// activations broadcast, straight into int32 (no 16-bit intermediate); a sub-block's sum (8
// steps for Q4_K's 32 weights, 4 for Q6_K's 16) is multiplied by the columns' scales (vpmulld)
// and added. Every integer is exact in int32 (Q4_K: |S1| <= 8 * 32 * 15 * 127 * 63; Q6_K:
// |S| <= 16 * 16 * 63 * 127 * 128), so the sums per (row, column, super-block) are the ones
// every other K-quant path forms, and the float steps are the same separate roundings in the
// same block order from the same 0.f: each output has the bits of the row-group path, and of
// the AVX2 GEMM. The min (Q4_K) and -32 offset (Q6_K) sums run as there: vpdpwssd of a column's
// 16-bit pair of mins (scales) by a row's pair of sub-block sums.
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "kquant.h"
#include "kquant_tile512.h"
#include "parallel.h"

namespace agentx {
namespace {

using kquant::kBlock;
using kquant::Rows;
using tile512::kGroups;
using tile512::kLanes;
using tile512::kRowChunk;
using tile512::kSteps;
using tile512::kTileCols;
using tile512::pair16;
using tile512::Tile;

// S1 (Q4_K) or sum_j sc_j (q_j . x_j) (Q6_K) of R rows x the tile's groups, a column a lane.
// Not inlined: inside rows_block GCC's register allocation adds a copy of each accumulator a
// step (measured: 2/3 of the standalone function's speed).
template <int R, int64_t Type>
AGENTX_AVX512 __attribute__((noinline)) void dots(const Tile& t, const int8_t* const* x,
                                                  __m512i (*out)[kGroups]) {
  constexpr int kSub = Type == kQ4K ? 8 : 4;  // steps a sub-block (one scale)
  __m512i acc[R][kGroups];
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < kGroups; ++g) acc[r][g] = _mm512_setzero_si512();
  }
  for (int j = 0; j < kSteps / kSub; ++j) {
    __m512i sub[R][kGroups];
    for (int r = 0; r < R; ++r) {
      for (int g = 0; g < kGroups; ++g) sub[r][g] = _mm512_setzero_si512();
    }
    // unrolled, GCC keeps the 24 accumulators in registers (rolled: a copy of each a step)
#pragma GCC unroll 8
    for (int i = 0; i < kSub; ++i) {
      const int s = j * kSub + i;
      __m512i wv[kGroups];
      for (int g = 0; g < kGroups; ++g) wv[g] = _mm512_load_si512(t.q[g][s]);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, x[r] + 4 * s, 4);
        const __m512i xv = _mm512_set1_epi32(four);
        for (int g = 0; g < kGroups; ++g) sub[r][g] = _mm512_dpbusd_epi32(sub[r][g], wv[g], xv);
      }
    }
    for (int g = 0; g < kGroups; ++g) {
      const __m512i sc = _mm512_load_si512(t.scale[g][j]);
      for (int r = 0; r < R; ++r) {
        acc[r][g] = _mm512_add_epi32(acc[r][g], _mm512_mullo_epi32(sub[r][g], sc));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < kGroups; ++g) out[r][g] = acc[r][g];
  }
}

// lane c: sum_p of column c's pair p times the row's pair p (vpdpwssd): Q4_K's min sum S2 or
// Q6_K's sum_j sc_j sum(x_j), exact in int32.
template <int P>
AGENTX_AVX512 inline __m512i pair_sums(const Tile& t, int g, const int32_t* row_pairs) {
  __m512i s = _mm512_setzero_si512();
  for (int p = 0; p < P; ++p) {
    const __m512i column = _mm512_load_si512(t.pairs[g][p]);
    s = _mm512_dpwssd_epi32(s, column, _mm512_set1_epi32(row_pairs[p]));
  }
  return s;
}

// Row i's (the activation block at a.dx[i], a.sums[i * 16]) pairs for pair_sums: Q4_K's sums
// of 32-weight sub-blocks 2p, 2p + 1 (|.| <= 4064), Q6_K's sums of 16 as they are.
template <int64_t Type>
inline void row_pairs(const Rows& a, int64_t i, int32_t* out) {
  const int16_t* s = a.sums + i * 16;
  if (Type == kQ4K) {
    for (int p = 0; p < 4; ++p) {
      out[p] = pair16(static_cast<int16_t>(s[4 * p] + s[4 * p + 1]),
                      static_cast<int16_t>(s[4 * p + 2] + s[4 * p + 3]));
    }
  } else {
    std::memcpy(out, s, 32);
  }
}

// The row step from the VNNI sums: s = S1 (Q4_K, S2 from the row's pairs) or Q6_K's sum
// without its offset (taken out here with the pairs).
template <int64_t Type>
AGENTX_AVX512 inline void step_row(const Tile& t, int g, __m512i s, const int32_t* pairs,
                                   float dx, bool first, float* yr, __mmask16 mask) {
  const __m512 d = _mm512_load_ps(t.d + kLanes * g);
  if (Type == kQ4K) {
    const __m512 dmin = _mm512_load_ps(t.dmin + kLanes * g);
    tile512::q4k_row(d, dmin, s, pair_sums<4>(t, g, pairs), dx, first, yr, mask);
  } else {
    s = _mm512_sub_epi32(s, _mm512_slli_epi32(pair_sums<8>(t, g, pairs), 5));
    tile512::q6k_row(d, s, dx, first, yr, mask);
  }
}

// Rows [r0, r0 + R) against the unpacked block b of the tile whose first column is y's.
template <int R, int64_t Type>
AGENTX_AVX512 void rows_block(const Tile& t, int ncols, const Rows& a, int64_t r0, int64_t b,
                              float* y, int64_t ldy) {
  const int8_t* x[R];
  int32_t pairs[R][8];
  float dx[R];
  for (int r = 0; r < R; ++r) {
    const int64_t i = (r0 + r) * a.blocks + b;
    x[r] = a.xq + (r0 + r) * a.k + b * kBlock;
    dx[r] = a.dx[i];
    row_pairs<Type>(a, i, pairs[r]);
  }
  __m512i acc[R][kGroups];
  dots<R, Type>(t, x, acc);
  for (int g = 0; g < kGroups && kLanes * g < ncols; ++g) {
    const __mmask16 mask = tile512::group_mask(ncols, g);
    for (int r = 0; r < R; ++r) {
      float* yr = y + (r0 + r) * ldy + kLanes * g;
      step_row<Type>(t, g, acc[r][g], pairs[r], dx[r], b == 0, yr, mask);
    }
  }
}

// Rows [m0, m1) x the tile's columns [n0, n0 + ncols), block after block.
template <int64_t Type>
AGENTX_AVX512 void tile_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int ncols,
                             const Rows& a, int64_t m0, int64_t m1, float* y, int64_t ldy,
                             Tile& t) {
  constexpr int64_t bytes = Type == kQ4K ? kquant::kQ4KBytes : kquant::kQ6KBytes;
  for (int64_t b = 0; b < a.blocks; ++b) {
    if (b + 1 < a.blocks) kquant::prefetch_next_block(w, row_bytes, n0, ncols, b, bytes);
    tile512::unpack<Type>(w, row_bytes, n0, ncols, b, t);
    kquant::rows_by_4(m0, m1, [&](auto rows, int64_t r0) {
      rows_block<decltype(rows)::value, Type>(t, ncols, a, r0, b, y + n0, ldy);
    });
  }
}

}  // namespace

void kquant_gemm_avx512(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n,
                        const int8_t* xq, const float* dx, const int16_t* sums, int64_t k,
                        int64_t m, float* y, int64_t ldy) {
  const Rows a{xq, dx, sums, k, k / kBlock};
  kquant::for_each_tile<Tile>(n, m, kTileCols, kRowChunk, [&](Tile& tile, int64_t n0, int ncols,
                                                              int64_t m0, int64_t m1) {
    if (type == kQ4K) {
      tile_rows<kQ4K>(w, row_bytes, n0, ncols, a, m0, m1, y, ldy, tile);
    } else {
      tile_rows<kQ6K>(w, row_bytes, n0, ncols, a, m0, m1, y, ldy, tile);
    }
  });
}

}  // namespace agentx
