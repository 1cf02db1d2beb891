// GGUF K-quant linear layers (Q4_K, Q6_K) for many activation rows at once (prefill), AVX2.
//
// qlinear_kquant.cpp sweeps the packed weights once per group of <= 4 rows, unpacking every
// super-block again for each group. Here each thread takes tiles of kTileCols output columns;
// for each super-block b it unpacks the tile's weights once into an L1-resident Tile (one uint8
// a weight, the sub-block scales pre-broadcast to 16-bit lanes) and then runs every row against
// it, 4 rows x 2 columns of accumulators at a time:
//
//   for tile of 32 columns:            (threads split the tiles)
//     y[:, tile] = 0
//     for b in super-blocks:           (in order: the float steps fold block after block)
//       unpack tile's block b          -> Tile
//       for rows r0, r0 + 4, ...:      exact int32 sums of 4 rows x 8 columns, then
//         y[r, c] = y[r, c] + step(...)   (kquant.h's roundings, 8 columns a vector)
//
// The integer sums per (row, column, super-block) are the ones qlinear_kquant.cpp forms (exact
// int32, any order: maddubs pairs stay below int16's limit, 2 * 63 * 127 for Q6_K), and the
// float steps are the same separate roundings in the same block order from the same 0.f, so
// every output has the bits of the row-group path: a row's result depends on that row alone.
// The min (Q4_K) and -32 offset (Q6_K) sums run with columns in lanes: madd of a column's
// 16-bit pair of mins (scales) by a row's pair of sub-block sums, no horizontal sum needed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "kquant.h"

namespace agentx {
namespace {

using kquant::kBlock;
using kquant::Rows;

constexpr int64_t kTileCols = 32;  // 8 KB of weights + 8 KB of scales: stays in L1
constexpr int kGroups = kTileCols / 8;
constexpr int kSteps = kBlock / 32;  // 32-weight vectors a super-block

// One super-block of kTileCols columns, unpacked. Columns past the layer's end are zeros.
struct Tile {
  alignas(32) uint8_t q[kTileCols][kBlock];           // weights in input order
  alignas(32) int16_t scale[kTileCols][kSteps][16];  // step v's scale a 16-bit lane
  // columns in lanes: group g, pair p, lane c = column 8 g + c's 16-bit (mins | scales) of
  // sub-blocks 2p, 2p + 1 (Q4_K: 4 pairs of 32-weight mins; Q6_K: 8 pairs of 16-weight scales)
  alignas(32) int16_t pairs[kGroups][8][16];
  alignas(16) uint16_t d[kTileCols];     // fp16
  alignas(16) uint16_t dmin[kTileCols];  // fp16, Q4_K only
};

inline void store(void* dst, __m256i v) { _mm256_store_si256(static_cast<__m256i*>(dst), v); }

inline __m256i load(const void* src) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(src));
}

// 8 vectors of 8 int32 -> one vector whose lane c is the sum of v[c] (exact in any order).
inline __m256i reduce8(const __m256i* v) {
  const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}

void unpack_q4k(const uint8_t* blk, Tile& t, int c) {
  int16_t sc[8], mn[8];
  kquant::q4k_scales(blk + 4, sc, mn);
  std::memcpy(&t.d[c], blk, 2);
  std::memcpy(&t.dmin[c], blk + 2, 2);
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {  // 32 bytes: low nibbles weights 64 j.., high ones 64 j + 32..
    const __m256i packed = load(blk + 16 + 32 * j);
    store(t.q[c] + 64 * j, _mm256_and_si256(packed, low));
    store(t.q[c] + 64 * j + 32, _mm256_and_si256(_mm256_srli_epi16(packed, 4), low));
  }
  for (int v = 0; v < kSteps; ++v) store(t.scale[c][v], _mm256_set1_epi16(sc[v]));
  for (int p = 0; p < 4; ++p) {
    t.pairs[c / 8][p][2 * (c % 8)] = mn[2 * p];
    t.pairs[c / 8][p][2 * (c % 8) + 1] = mn[2 * p + 1];
  }
}

void unpack_q6k(const uint8_t* blk, Tile& t, int c) {
  std::memcpy(&t.d[c], blk + 208, 2);
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
  const __m256i mid = _mm256_set1_epi8(0x0C), top = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {  // 128 weights: 64 low-nibble bytes, 32 bytes of 2-bit highs
    const __m256i l0 = load(blk + 64 * h), l1 = load(blk + 64 * h + 32);
    const __m256i qh = load(blk + 128 + 32 * h);
    uint8_t* q = t.q[c] + 128 * h;
    store(q, _mm256_or_si256(_mm256_and_si256(l0, low),
                             _mm256_slli_epi16(_mm256_and_si256(qh, two), 4)));
    store(q + 32, _mm256_or_si256(_mm256_and_si256(l1, low),
                                  _mm256_slli_epi16(_mm256_and_si256(qh, mid), 2)));
    store(q + 64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                                  _mm256_and_si256(qh, top)));
    store(q + 96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                  _mm256_and_si256(_mm256_srli_epi16(qh, 2), top)));
  }
  for (int v = 0; v < kSteps; ++v) {  // 16 weights a scale: two per 32-weight step
    store(t.scale[c][v], _mm256_set_m128i(_mm_set1_epi16(sc[2 * v + 1]), _mm_set1_epi16(sc[2 * v])));
  }
  for (int p = 0; p < 8; ++p) {
    t.pairs[c / 8][p][2 * (c % 8)] = sc[2 * p];
    t.pairs[c / 8][p][2 * (c % 8) + 1] = sc[2 * p + 1];
  }
}

// Columns [ncols, kTileCols) of the tile: zero weights, scales and fp16 zeros.
void clear_tail(Tile& t, int ncols) {
  for (int c = ncols; c < kTileCols; ++c) {
    std::memset(t.q[c], 0, sizeof(t.q[c]));
    std::memset(t.scale[c], 0, sizeof(t.scale[c]));
    for (int p = 0; p < 8; ++p) t.pairs[c / 8][p][2 * (c % 8)] = t.pairs[c / 8][p][2 * (c % 8) + 1] = 0;
    t.d[c] = t.dmin[c] = 0;
  }
}

// The weight sums of R rows x 8 columns (group g) of one super-block, lanes not yet summed:
// out[r][c] = sum over steps of madd(maddubs(q_c, x_r), scale_c).
template <int R>
inline void dots(const Tile& t, int g, const int8_t* const* x, __m256i (*out)[8]) {
  for (int c = 8 * g; c < 8 * g + 8; c += 2) {
    __m256i a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
    for (int v = 0; v < kSteps; ++v) {
      const __m256i w0 = load(t.q[c] + 32 * v), w1 = load(t.q[c + 1] + 32 * v);
      const __m256i s0 = load(t.scale[c][v]), s1 = load(t.scale[c + 1][v]);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = load(x[r] + 32 * v);
        a0[r] = _mm256_add_epi32(a0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, xv), s0));
        a1[r] = _mm256_add_epi32(a1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, xv), s1));
      }
    }
    for (int r = 0; r < R; ++r) {
      out[r][c - 8 * g] = a0[r];
      out[r][c - 8 * g + 1] = a1[r];
    }
  }
}

// lane c: sum_p madd(pairs[p] of column c, row pair p): the Q4_K min sum S2 or Q6_K's
// sum_j sc_j sum(x_j), exact in int32.
template <int P>
inline __m256i pair_sums(const Tile& t, int g, const int32_t* row_pairs) {
  __m256i s = _mm256_setzero_si256();
  for (int p = 0; p < P; ++p) {
    s = _mm256_add_epi32(s, _mm256_madd_epi16(load(t.pairs[g][p]), _mm256_set1_epi32(row_pairs[p])));
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
  for (int g = 0; 8 * g < ncols; ++g) {
    const int valid = std::min(8, ncols - 8 * g);
    const __m256i mask =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i acc[R][8];
    dots<R>(t, g, x, acc);
    const __m256 d = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(t.d + 8 * g)));
    for (int r = 0; r < R; ++r) {
      float* yr = y + (r0 + r) * ldy + 8 * g;
      const __m256 acc_y = load_y(yr, mask, valid == 8);
      __m256 p;
      if (Type == kQ4K) {
        const __m256 dmin =
            _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(t.dmin + 8 * g)));
        const __m256 av = _mm256_mul_ps(d, _mm256_cvtepi32_ps(reduce8(acc[r])));
        const __m256 bv = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(pair_sums<4>(t, g, row_pairs[r])));
        p = _mm256_mul_ps(_mm256_set1_ps(dx[r]), _mm256_sub_ps(av, bv));
      } else {
        const __m256i off = _mm256_slli_epi32(pair_sums<8>(t, g, row_pairs[r]), 5);  // 32 sc.sum
        const __m256i s = _mm256_sub_epi32(reduce8(acc[r]), off);
        p = _mm256_mul_ps(_mm256_set1_ps(dx[r]), _mm256_mul_ps(d, _mm256_cvtepi32_ps(s)));
      }
      store_y(yr, _mm256_add_ps(acc_y, p), mask, valid == 8);
    }
  }
}

template <int64_t Type>
void tile_columns(const uint8_t* w, int64_t row_bytes, int64_t n0, int ncols, const Rows& a,
                  int64_t m, float* y, int64_t ldy, Tile& t) {
  constexpr int64_t bytes = Type == kQ4K ? kquant::kQ4KBytes : kquant::kQ6KBytes;
  for (int64_t r = 0; r < m; ++r) std::fill_n(y + r * ldy + n0, ncols, 0.f);
  clear_tail(t, ncols);
  for (int64_t b = 0; b < a.blocks; ++b) {
    for (int c = 0; c < ncols; ++c) {
      const uint8_t* blk = w + (n0 + c) * row_bytes + b * bytes;
      if (Type == kQ4K) {
        unpack_q4k(blk, t, c);
      } else {
        unpack_q6k(blk, t, c);
      }
    }
    int64_t r0 = 0;
    for (; r0 + 4 <= m; r0 += 4) rows_block<4, Type>(t, ncols, a, r0, b, y + n0, ldy);
    switch (m - r0) {
      case 3: rows_block<3, Type>(t, ncols, a, r0, b, y + n0, ldy); break;
      case 2: rows_block<2, Type>(t, ncols, a, r0, b, y + n0, ldy); break;
      case 1: rows_block<1, Type>(t, ncols, a, r0, b, y + n0, ldy); break;
      default: break;
    }
  }
}

}  // namespace

void kquant_gemm_avx2(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n,
                      const int8_t* xq, const float* dx, const int16_t* sums, int64_t k,
                      int64_t m, float* y, int64_t ldy) {
  const Rows a{xq, dx, sums, k, k / kBlock};
  at::parallel_for(0, (n + kTileCols - 1) / kTileCols, 1, [&](int64_t t0, int64_t t1) {
    Tile tile;
    for (int64_t i = t0; i < t1; ++i) {
      const int64_t n0 = i * kTileCols;
      const int ncols = static_cast<int>(std::min(kTileCols, n - n0));
      if (type == kQ4K) {
        tile_columns<kQ4K>(w, row_bytes, n0, ncols, a, m, y, ldy, tile);
      } else {
        tile_columns<kQ6K>(w, row_bytes, n0, ncols, a, m, y, ldy, tile);
      }
    }
  });
}

}  // namespace agentx
