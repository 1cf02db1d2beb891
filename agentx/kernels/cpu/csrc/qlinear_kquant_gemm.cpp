// GGUF K-quant linear layers (Q4_K, Q6_K) for many activation rows at once (prefill), AVX2.
//
// qlinear_kquant.cpp sweeps the packed weights once per group of <= 4 rows, unpacking every
// super-block again for each group. Here each thread takes tiles of kTileCols output columns;
// for each super-block b it unpacks the tile's weights once into an L1-resident Tile (one uint8
// a weight, 8 columns interleaved in the int32 lanes of a vector) and runs up to 256 rows
// against it, 4 rows x 16 columns of accumulators at a time:
//
//   for tile of 32 columns:            (threads split the tiles)
//     for rows m0 .. m0 + 256:
//       y[rows, tile] = 0
//       for b in super-blocks:         (in order: the float steps fold block after block)
//         unpack tile's block b        -> Tile
//         for rows r0, r0 + 4, ...:    exact int32 sums of 4 rows x 16 columns, then
//           y[r, c] = y[r, c] + step(...)   (kquant.h's roundings, 8 columns a vector)
//
// A step is one maddubs of 8 columns x 4 weights against a row's 4 activations broadcast;
// steps are summed in 16 bits within a sub-block (exact, see dots) and one madd applies the
// columns' scales, so Q4_K needs 9 multiplies per 256 products where the row-group path needs
// 16, and every column's sum ends in its own lane (no horizontal sums).
//
// The integer sums per (row, column, super-block) are the ones qlinear_kquant.cpp forms (exact
// int32, any order), and the float steps are the same separate roundings in the same block
// order from the same 0.f, so every output has the bits of the row-group path: a row's result
// depends on that row alone. The min (Q4_K) and -32 offset (Q6_K) sums also run with columns in
// lanes: madd of a column's 16-bit pair of mins (scales) by a row's pair of sub-block sums.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "parallel.h"
#include "kquant.h"

namespace agentx {
namespace {

using kquant::kBlock;
using kquant::Rows;

constexpr int64_t kTileCols = 32;  // 8 KB of weights + 2 KB of scales: stays in L1
constexpr int kGroups = kTileCols / 8;
// Rows a pass over a tile: their activations (256 B a row and block) and outputs (128 B a row)
// stay in L2; longer prompts unpack the tile again per chunk (measured: 1024 rows at once ran
// down 25% slower than 256).
constexpr int64_t kRowChunk = 256;
constexpr int kSteps = kBlock / 4;  // 4-weight steps a super-block

// One super-block of kTileCols columns, unpacked, 8 columns (a group) in the 8 int32 lanes of
// a vector: step s of group g holds weights 4 s .. 4 s + 3 of each of its columns, so one
// maddubs against a row's 4 activations broadcast gives every column's partial dot in its own
// lane (no horizontal sums). Columns past the layer's end are zeros.
struct Tile {
  alignas(32) uint8_t q[kGroups][kSteps][32];
  // group g, sub-block j (Q4_K: 8 of 32 weights, Q6_K: 16 of 16): lanes 2c, 2c + 1 = column
  // 8 g + c's scale
  alignas(32) int16_t scale[kGroups][16][16];
  // group g, pair p, lanes 2c, 2c + 1 = column 8 g + c's (mins | scales) of sub-blocks 2p,
  // 2p + 1 (Q4_K: 4 pairs of 32-weight mins; Q6_K: 8 pairs of 16-weight scales)
  alignas(32) int16_t pairs[kGroups][8][16];
  alignas(16) uint16_t d[kTileCols];     // fp16
  alignas(16) uint16_t dmin[kTileCols];  // fp16, Q4_K only
};

inline void store(void* dst, __m256i v) { _mm256_store_si256(static_cast<__m256i*>(dst), v); }

inline __m256i load(const void* src) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(src));
}

inline void set_pair(int16_t* lanes, int c, int16_t lo, int16_t hi) {
  lanes[2 * c] = lo;
  lanes[2 * c + 1] = hi;
}

// Column c of group g: its 256 weights (0..15) into col, its scales and mins into the tile.
void unpack_q4k(const uint8_t* blk, Tile& t, int g, int c, uint8_t* col) {
  int16_t sc[8], mn[8];
  kquant::q4k_scales(blk + 4, sc, mn);
  std::memcpy(&t.d[8 * g + c], blk, 2);
  std::memcpy(&t.dmin[8 * g + c], blk + 2, 2);
  kquant::q4k_weight_bytes(blk, col);
  for (int j = 0; j < 8; ++j) set_pair(t.scale[g][j], c, sc[j], sc[j]);
  for (int p = 0; p < 4; ++p) set_pair(t.pairs[g][p], c, mn[2 * p], mn[2 * p + 1]);
}

// Column c of group g: its 256 weights (0..63, the -32 left to the offset sums) into col.
void unpack_q6k(const uint8_t* blk, Tile& t, int g, int c, uint8_t* col) {
  std::memcpy(&t.d[8 * g + c], blk + 208, 2);
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  kquant::q6k_weight_bytes(blk, col);
  for (int j = 0; j < 16; ++j) set_pair(t.scale[g][j], c, sc[j], sc[j]);
  for (int p = 0; p < 8; ++p) set_pair(t.pairs[g][p], c, sc[2 * p], sc[2 * p + 1]);
}

// Group g of the tile all zeros (columns past the layer's end).
void clear_group(Tile& t, int g) {
  std::memset(t.q[g], 0, sizeof(t.q[g]));
  std::memset(t.scale[g], 0, sizeof(t.scale[g]));
  std::memset(t.pairs[g], 0, sizeof(t.pairs[g]));
  std::fill_n(t.d + 8 * g, 8, uint16_t{0});
  std::fill_n(t.dmin + 8 * g, 8, uint16_t{0});
}

// S1 (Q4_K) or sum_j sc_j (q_j . x_j) (Q6_K) of R rows x groups g, g + 1, a column a lane.
// Per sub-block the maddubs pairs are summed in 16 bits, then madd applies the scales: Q4_K
// sums 8 steps of at most 2 * 15 * 127 = 3810 (30480), Q6_K 2 steps of at most 2 * 63 * 127 =
// 16002 (32004), both below 32767, so every partial sum is exact.
template <int R, int64_t Type>
inline void dots(const Tile& t, int g, const int8_t* const* x, __m256i (*out)[2]) {
  constexpr int kRun = Type == kQ4K ? 8 : 2;          // steps summed in 16 bits
  constexpr int kSubSteps = Type == kQ4K ? 8 : 4;     // steps a sub-block (one scale)
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int s0 = 0; s0 < kSteps; s0 += kRun) {
    __m256i p[R][2];
    for (int r = 0; r < R; ++r) p[r][0] = p[r][1] = _mm256_setzero_si256();
    // unrolled, GCC sums the 8 steps as a tree and spills every product to the stack
#pragma GCC unroll 1
    for (int s = s0; s < s0 + kRun; ++s) {
      const __m256i w0 = load(t.q[g][s]), w1 = load(t.q[g + 1][s]);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, x[r] + 4 * s, 4);
        const __m256i xv = _mm256_set1_epi32(four);
        p[r][0] = _mm256_add_epi16(p[r][0], _mm256_maddubs_epi16(w0, xv));
        p[r][1] = _mm256_add_epi16(p[r][1], _mm256_maddubs_epi16(w1, xv));
      }
    }
    const __m256i sc0 = load(t.scale[g][s0 / kSubSteps]);
    const __m256i sc1 = load(t.scale[g + 1][s0 / kSubSteps]);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(p[r][0], sc0));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(p[r][1], sc1));
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r][0] = acc[r][0];
    out[r][1] = acc[r][1];
  }
}

// lane c: sum_p madd(pairs[p] of column c, row pair p): the Q4_K min sum S2 or Q6_K's
// sum_j sc_j sum(x_j), exact in int32.
template <int P>
inline __m256i pair_sums(const Tile& t, int g, const int32_t* row_pairs) {
  __m256i s = _mm256_setzero_si256();
  for (int p = 0; p < P; ++p) {
    const __m256i rp = _mm256_set1_epi32(row_pairs[p]);
    s = _mm256_add_epi32(s, _mm256_madd_epi16(load(t.pairs[g][p]), rp));
  }
  return s;
}

// y (8 columns) = y + step; the last group of a layer whose width is not a multiple of 8 masks.
inline __m256 load_y(const float* y, __m256i mask, bool full) {
  return full ? _mm256_loadu_ps(y) : _mm256_maskload_ps(y, mask);
}

inline void store_y(float* y, __m256 v, __m256i mask, bool full) {
  if (full) {
    _mm256_storeu_ps(y, v);
  } else {
    _mm256_maskstore_ps(y, mask, v);
  }
}

// Rows [r0, r0 + R) against the unpacked block b of the tile whose first column is y's.
template <int R, int64_t Type>
void rows_block(const Tile& t, int ncols, const Rows& a, int64_t r0, int64_t b, float* y,
                int64_t ldy) {
  const int8_t* x[R];
  int32_t row_pairs[R][8];
  float dx[R];
  for (int r = 0; r < R; ++r) {
    const int64_t i = (r0 + r) * a.blocks + b;
    x[r] = a.xq + (r0 + r) * a.k + b * kBlock;
    dx[r] = a.dx[i];
    const int16_t* s = a.sums + i * 16;
    if (Type == kQ4K) {  // pair p: the sums of 32-weight sub-blocks 2p, 2p + 1 (|.| <= 4064)
      for (int p = 0; p < 4; ++p) {
        const int16_t pair[2] = {static_cast<int16_t>(s[4 * p] + s[4 * p + 1]),
                                 static_cast<int16_t>(s[4 * p + 2] + s[4 * p + 3])};
        std::memcpy(&row_pairs[r][p], pair, 4);
      }
    } else {
      std::memcpy(row_pairs[r], s, 32);
    }
  }
  for (int g = 0; 8 * g < ncols; g += 2) {
    __m256i acc[R][2];
    dots<R, Type>(t, g, x, acc);
    for (int h = 0; h < 2 && 8 * (g + h) < ncols; ++h) {
      const int valid = std::min(8, ncols - 8 * (g + h));
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      const __m256 d = _mm256_cvtph_ps(
          _mm_load_si128(reinterpret_cast<const __m128i*>(t.d + 8 * (g + h))));
      for (int r = 0; r < R; ++r) {
        float* yr = y + (r0 + r) * ldy + 8 * (g + h);
        const __m256 acc_y = load_y(yr, mask, valid == 8);
        __m256 p;
        if (Type == kQ4K) {
          const __m256 dmin = _mm256_cvtph_ps(
              _mm_load_si128(reinterpret_cast<const __m128i*>(t.dmin + 8 * (g + h))));
          const __m256i s2 = pair_sums<4>(t, g + h, row_pairs[r]);
          const __m256 av = _mm256_mul_ps(d, _mm256_cvtepi32_ps(acc[r][h]));
          const __m256 bv = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(s2));
          p = _mm256_mul_ps(_mm256_set1_ps(dx[r]), _mm256_sub_ps(av, bv));
        } else {  // 32 sum_j sc_j sum(x_j): the -32 of every weight
          const __m256i off = _mm256_slli_epi32(pair_sums<8>(t, g + h, row_pairs[r]), 5);
          const __m256i s = _mm256_sub_epi32(acc[r][h], off);
          p = _mm256_mul_ps(_mm256_set1_ps(dx[r]), _mm256_mul_ps(d, _mm256_cvtepi32_ps(s)));
        }
        store_y(yr, _mm256_add_ps(acc_y, p), mask, valid == 8);
      }
    }
  }
}

// Rows [m0, m1) x the tile's columns [n0, n0 + ncols), block after block.
template <int64_t Type>
void tile_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int ncols, const Rows& a,
               int64_t m0, int64_t m1, float* y, int64_t ldy, Tile& t) {
  constexpr int64_t bytes = Type == kQ4K ? kquant::kQ4KBytes : kquant::kQ6KBytes;
  for (int64_t r = m0; r < m1; ++r) std::fill_n(y + r * ldy + n0, ncols, 0.f);
  const int groups = (ncols + 7) / 8;
  for (int g = groups; g < kGroups; ++g) clear_group(t, g);
  alignas(32) uint8_t cols[8][kBlock];
  for (int64_t b = 0; b < a.blocks; ++b) {
    if (b + 1 < a.blocks) kquant::prefetch_next_block(w, row_bytes, n0, ncols, b, bytes);
    for (int g = 0; g < groups; ++g) {
      for (int c = 0; c < 8; ++c) {
        if (8 * g + c >= ncols) {  // a partial group: zeros past the end
          std::memset(cols[c], 0, kBlock);
          continue;
        }
        const uint8_t* blk = w + (n0 + 8 * g + c) * row_bytes + b * bytes;
        if (Type == kQ4K) {
          unpack_q4k(blk, t, g, c, cols[c]);
        } else {
          unpack_q6k(blk, t, g, c, cols[c]);
        }
      }
      kquant::interleave8(cols, t.q[g][0], 32);
    }
    kquant::rows_by_4(m0, m1, [&](auto rows, int64_t r0) {
      rows_block<decltype(rows)::value, Type>(t, ncols, a, r0, b, y + n0, ldy);
    });
  }
}

}  // namespace

void kquant_gemm_avx2(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n,
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
