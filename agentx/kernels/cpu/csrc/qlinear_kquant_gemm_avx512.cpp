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
#include "parallel.h"

#define AGENTX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq")))

namespace agentx {
namespace {

using kquant::kBlock;
using kquant::Rows;

constexpr int kLanes = 16;   // columns a group: the int32 lanes of a zmm
// 12 KB of weights + 5 KB of scales: stays in L1; a call of dots (4 rows, kquant::rows_by_4)
// keeps 4 x 3 sub-block and 4 x 3 block accumulators
constexpr int kGroups = 3;
constexpr int64_t kTileCols = kLanes * kGroups;
constexpr int64_t kRowChunk = 256;  // rows a pass over a tile (their x and y stay in L2)
constexpr int kSteps = kBlock / 4;  // 4-weight steps a super-block

struct Tile {
  // group g, step s: lane c holds weights 4 s .. 4 s + 3 of column 16 g + c
  alignas(64) uint8_t q[kGroups][kSteps][64];
  // group g, sub-block j (Q4_K: 8 of 32 weights, Q6_K: 16 of 16): lane c = column's scale
  alignas(64) int32_t scale[kGroups][16][kLanes];
  // group g, pair p: lane c = column's 16-bit (mins | scales) of sub-blocks 2p (low), 2p + 1
  alignas(64) int32_t pairs[kGroups][8][kLanes];
  alignas(64) float d[kTileCols];
  alignas(64) float dmin[kTileCols];  // Q4_K only
};

inline int32_t pair16(int16_t lo, int16_t hi) {
  return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(lo)) |
                              (static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16));
}

// Column c (of the tile) of block blk: its weights into col, its scales into the tile.
void unpack_q4k(const uint8_t* blk, Tile& t, int c, uint8_t* col) {
  const int g = c / kLanes, lane = c % kLanes;
  int16_t sc[8], mn[8];
  kquant::q4k_scales(blk + 4, sc, mn);
  t.d[c] = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk));
  t.dmin[c] = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2));
  kquant::q4k_weight_bytes(blk, col);
  for (int j = 0; j < 8; ++j) t.scale[g][j][lane] = sc[j];
  for (int p = 0; p < 4; ++p) t.pairs[g][p][lane] = pair16(mn[2 * p], mn[2 * p + 1]);
}

void unpack_q6k(const uint8_t* blk, Tile& t, int c, uint8_t* col) {
  const int g = c / kLanes, lane = c % kLanes;
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  t.d[c] = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 208));
  kquant::q6k_weight_bytes(blk, col);
  for (int j = 0; j < 16; ++j) t.scale[g][j][lane] = sc[j];
  for (int p = 0; p < 8; ++p) t.pairs[g][p][lane] = pair16(sc[2 * p], sc[2 * p + 1]);
}

// Column c of the tile all zeros (past the layer's end): weights, scales and d.
void clear_column(Tile& t, int c, uint8_t* col) {
  const int g = c / kLanes, lane = c % kLanes;
  std::memset(col, 0, kBlock);
  for (int j = 0; j < 16; ++j) t.scale[g][j][lane] = 0;
  for (int p = 0; p < 8; ++p) t.pairs[g][p][lane] = 0;
  t.d[c] = t.dmin[c] = 0.f;
}

// 8 x 8 int32 transpose: out[i] lane c = in[c] lane i.
inline void transpose8(const __m256i* r, __m256i* out) {
  __m256i u[8];
  for (int h = 0; h < 8; h += 4) {
    const __m256i t0 = _mm256_unpacklo_epi32(r[h], r[h + 1]);
    const __m256i t1 = _mm256_unpackhi_epi32(r[h], r[h + 1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[h + 2], r[h + 3]);
    const __m256i t3 = _mm256_unpackhi_epi32(r[h + 2], r[h + 3]);
    u[h] = _mm256_unpacklo_epi64(t0, t2);      // 0 | 4 of rows h .. h + 3
    u[h + 1] = _mm256_unpackhi_epi64(t0, t2);  // 1 | 5
    u[h + 2] = _mm256_unpacklo_epi64(t1, t3);  // 2 | 6
    u[h + 3] = _mm256_unpackhi_epi64(t1, t3);  // 3 | 7
  }
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    out[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// Group g of the tile from a Q4_K block of each of its 16 columns (blk[c]), without a bytes
// copy of each column: the same Tile as unpack_q4k + interleave8 (tested against it).
//   weights: qs dword k of a column holds, in its low nibbles, weights 4 k' .. of chunk
//            j = k / 8 (k' = k % 8: step 16 j + k') and in its high nibbles those of step
//            16 j + 8 + k'; 8 x 8 transposes put dword k of 8 columns in one vector, whose
//            nibbles are then two steps of t.q.
//   scales:  the 4 header dwords (d | dmin, then the 12 scale bytes) of 16 columns transposed
//            into 4 vectors, and the 6-bit fields cut with q4k_scale_bytes's masks, 16 lanes
//            at once.
AGENTX_AVX512 void unpack_q4k_group(const uint8_t* const* blk, Tile& t, int g) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {  // columns 8 h .. 8 h + 7: bytes 32 h .. of each step
    for (int k0 = 0; k0 < 32; k0 += 8) {
      __m256i r[8], v[8];
      for (int c = 0; c < 8; ++c) {
        r[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[8 * h + c] + 16 + 4 * k0));
      }
      transpose8(r, v);
      const int s = 16 * (k0 / 8);  // k0 .. k0 + 7 are one chunk: steps s .. s + 7, s + 8 ..
      for (int i = 0; i < 8; ++i) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(t.q[g][s + i] + 32 * h),
                           _mm256_and_si256(v[i], low));
        _mm256_store_si256(reinterpret_cast<__m256i*>(t.q[g][s + 8 + i] + 32 * h),
                           _mm256_and_si256(_mm256_srli_epi16(v[i], 4), low));
      }
    }
  }
  // header dwords: z[q] = columns 4 q .. 4 q + 3, 4 dwords each
  __m512i z[4];
  for (int q = 0; q < 4; ++q) {
    const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[4 * q]));
    __m512i v = _mm512_castsi128_si512(first);
    for (int i = 1; i < 4; ++i) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[4 * q + i]));
      v = _mm512_inserti32x4(v, x, i);
    }
    z[q] = v;
  }
  const __m512i a = _mm512_unpacklo_epi32(z[0], z[1]), b2 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i c = _mm512_unpacklo_epi32(z[2], z[3]), d2 = _mm512_unpackhi_epi32(z[2], z[3]);
  // lane 4 L + p of each: column L + 4 p; the permute puts column i in lane i
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i u0 = _mm512_permutexvar_epi32(order, _mm512_unpacklo_epi64(a, c));  // d | dmin
  const __m512i u1 = _mm512_permutexvar_epi32(order, _mm512_unpackhi_epi64(a, c));
  const __m512i u2 = _mm512_permutexvar_epi32(order, _mm512_unpacklo_epi64(b2, d2));
  const __m512i u3 = _mm512_permutexvar_epi32(order, _mm512_unpackhi_epi64(b2, d2));
  const __m512i six = _mm512_set1_epi32(0x3F3F3F3F), four = _mm512_set1_epi32(0x0F0F0F0F);
  const __m512i two = _mm512_set1_epi32(0x03030303), byte = _mm512_set1_epi32(0xFF);
  const __m512i sc_lo = _mm512_and_si512(u1, six), m_lo = _mm512_and_si512(u2, six);
  const __m512i sc_hi =
      _mm512_or_si512(_mm512_and_si512(u3, four),
                      _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), two), 4));
  const __m512i m_hi = _mm512_or_si512(
      _mm512_and_si512(_mm512_srli_epi32(u3, 4), four),
      _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u2, 6), two), 4));
  for (int j = 0; j < 4; ++j) {
    _mm512_store_si512(t.scale[g][j], _mm512_and_si512(_mm512_srli_epi32(sc_lo, 8 * j), byte));
    _mm512_store_si512(t.scale[g][j + 4], _mm512_and_si512(_mm512_srli_epi32(sc_hi, 8 * j), byte));
  }
  // pair p: m[2p] in the low 16 bits, m[2p + 1] in the high ones
  const __m512i lo_byte = _mm512_set1_epi32(0xFF), second = _mm512_set1_epi32(0xFF00);
  for (int p = 0; p < 2; ++p) {
    const __m512i ml = _mm512_srli_epi32(m_lo, 16 * p), mh = _mm512_srli_epi32(m_hi, 16 * p);
    const __m512i lo_pair = _mm512_or_si512(_mm512_and_si512(ml, lo_byte),
                                            _mm512_slli_epi32(_mm512_and_si512(ml, second), 8));
    const __m512i hi_pair = _mm512_or_si512(_mm512_and_si512(mh, lo_byte),
                                            _mm512_slli_epi32(_mm512_and_si512(mh, second), 8));
    _mm512_store_si512(t.pairs[g][p], lo_pair);
    _mm512_store_si512(t.pairs[g][p + 2], hi_pair);
  }
  _mm512_store_ps(t.d + kLanes * g, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(u0)));
  const __m256i dmin_half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(u0, 16));
  _mm512_store_ps(t.dmin + kLanes * g, _mm512_cvtph_ps(dmin_half));
}

// The tile's block b: every column unpacked, then 8 columns at a time interleaved into t.q;
// Q4_K groups of 16 whole columns by unpack_q4k_group.
template <int64_t Type>
AGENTX_AVX512 void unpack(const uint8_t* w, int64_t row_bytes, int64_t n0, int ncols, int64_t b,
                          Tile& t) {
  constexpr int64_t bytes = Type == kQ4K ? kquant::kQ4KBytes : kquant::kQ6KBytes;
  alignas(32) uint8_t cols[8][kBlock];
  for (int c0 = 0; c0 < kTileCols; c0 += 8) {
    if (Type == kQ4K && c0 % kLanes == 0 && c0 + kLanes <= ncols) {
      const uint8_t* blk[kLanes];
      for (int i = 0; i < kLanes; ++i) blk[i] = w + (n0 + c0 + i) * row_bytes + b * bytes;
      unpack_q4k_group(blk, t, c0 / kLanes);
      c0 += 8;  // the group's second 8 columns too
      continue;
    }
    for (int i = 0; i < 8; ++i) {
      const int c = c0 + i;
      if (c >= ncols) {
        clear_column(t, c, cols[i]);
        continue;
      }
      const uint8_t* blk = w + (n0 + c) * row_bytes + b * bytes;
      if (Type == kQ4K) {
        unpack_q4k(blk, t, c, cols[i]);
      } else {
        unpack_q6k(blk, t, c, cols[i]);
      }
    }
    kquant::interleave8(cols, t.q[c0 / kLanes][0] + 4 * (c0 % kLanes), 64);
  }
}

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
    s = _mm512_dpwssd_epi32(s, _mm512_load_si512(t.pairs[g][p]), _mm512_set1_epi32(row_pairs[p]));
  }
  return s;
}

// Rows [r0, r0 + R) against the unpacked block b of the tile whose first column is y's.
template <int R, int64_t Type>
AGENTX_AVX512 void rows_block(const Tile& t, int ncols, const Rows& a, int64_t r0, int64_t b,
                              float* y, int64_t ldy) {
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
        row_pairs[r][p] = pair16(static_cast<int16_t>(s[4 * p] + s[4 * p + 1]),
                                 static_cast<int16_t>(s[4 * p + 2] + s[4 * p + 3]));
      }
    } else {
      std::memcpy(row_pairs[r], s, 32);
    }
  }
  __m512i acc[R][kGroups];
  dots<R, Type>(t, x, acc);
  for (int g = 0; g < kGroups && kLanes * g < ncols; ++g) {
    const int valid = std::min(kLanes, ncols - kLanes * g);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 d = _mm512_load_ps(t.d + kLanes * g);
    for (int r = 0; r < R; ++r) {
      float* yr = y + (r0 + r) * ldy + kLanes * g;
      // block 0 adds to 0.f as the other paths do (-0.f + 0.f = 0.f), without reading y
      const __m512 acc_y = b == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, yr);
      __m512 p;
      if (Type == kQ4K) {
        const __m512 dmin = _mm512_load_ps(t.dmin + kLanes * g);
        const __m512i s2 = pair_sums<4>(t, g, row_pairs[r]);
        const __m512 av = _mm512_mul_ps(d, _mm512_cvtepi32_ps(acc[r][g]));
        const __m512 bv = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(s2));
        p = _mm512_mul_ps(_mm512_set1_ps(dx[r]), _mm512_sub_ps(av, bv));
      } else {  // 32 sum_j sc_j sum(x_j): the -32 of every weight
        const __m512i off = _mm512_slli_epi32(pair_sums<8>(t, g, row_pairs[r]), 5);
        const __m512i s = _mm512_sub_epi32(acc[r][g], off);
        p = _mm512_mul_ps(_mm512_set1_ps(dx[r]), _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
      }
      _mm512_mask_storeu_ps(yr, mask, _mm512_add_ps(acc_y, p));
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
    unpack<Type>(w, row_bytes, n0, ncols, b, t);
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
