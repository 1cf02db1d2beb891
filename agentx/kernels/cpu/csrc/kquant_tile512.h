// The unpacked weight tile the AVX-512 K-quant GEMMs share (qlinear_kquant_gemm_avx512.cpp:
// vpdpbusd; qlinear_kquant_gemm_amx.cpp: AMX tiles): a super-block of kTileCols (48) columns,
// one byte a weight, 16 columns interleaved in the int32 lanes of a zmm, with their scales, and
// the float step that folds a block's exact integer sums of one row into y (kquant.h's
// roundings, 16 columns a vector).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "kquant.h"

#define AGENTX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq")))

namespace agentx {
namespace tile512 {

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
inline void unpack_q4k(const uint8_t* blk, Tile& t, int c, uint8_t* col) {
  const int g = c / kLanes, lane = c % kLanes;
  int16_t sc[8], mn[8];
  kquant::q4k_scales(blk + 4, sc, mn);
  t.d[c] = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk));
  t.dmin[c] = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2));
  kquant::q4k_weight_bytes(blk, col);
  for (int j = 0; j < 8; ++j) t.scale[g][j][lane] = sc[j];
  for (int p = 0; p < 4; ++p) t.pairs[g][p][lane] = pair16(mn[2 * p], mn[2 * p + 1]);
}

inline void unpack_q6k(const uint8_t* blk, Tile& t, int c, uint8_t* col) {
  const int g = c / kLanes, lane = c % kLanes;
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  t.d[c] = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 208));
  kquant::q6k_weight_bytes(blk, col);
  for (int j = 0; j < 16; ++j) t.scale[g][j][lane] = sc[j];
  for (int p = 0; p < 8; ++p) t.pairs[g][p][lane] = pair16(sc[2 * p], sc[2 * p + 1]);
}

// Column c of the tile all zeros (past the layer's end): weights, scales and d.
inline void clear_column(Tile& t, int c, uint8_t* col) {
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
AGENTX_AVX512 inline void unpack_q4k_group(const uint8_t* const* blk, Tile& t, int g) {
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
AGENTX_AVX512 inline void unpack(const uint8_t* w, int64_t row_bytes, int64_t n0, int ncols,
                                 int64_t b, Tile& t) {
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

// One row's block step on 16 columns (the valid ones in mask): y = y + dx * (d S1 - dmin S2)
// (Q4_K) or y + dx * (d S) (Q6_K, S with its -32 offset in), the columns' d and dmin in lanes.
// Block 0 adds to 0.f as the other paths do (-0.f + 0.f = 0.f), without reading y.
AGENTX_AVX512 inline void q4k_row(__m512 d, __m512 dmin, __m512i s1, __m512i s2, float dx,
                                  bool first, float* yr, __mmask16 mask) {
  const __m512 acc_y = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, yr);
  const __m512 av = _mm512_mul_ps(d, _mm512_cvtepi32_ps(s1));
  const __m512 bv = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(s2));
  const __m512 p = _mm512_mul_ps(_mm512_set1_ps(dx), _mm512_sub_ps(av, bv));
  _mm512_mask_storeu_ps(yr, mask, _mm512_add_ps(acc_y, p));
}

AGENTX_AVX512 inline void q6k_row(__m512 d, __m512i s, float dx, bool first, float* yr,
                                  __mmask16 mask) {
  const __m512 acc_y = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, yr);
  const __m512 p = _mm512_mul_ps(_mm512_set1_ps(dx), _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
  _mm512_mask_storeu_ps(yr, mask, _mm512_add_ps(acc_y, p));
}

// The mask of group g's valid columns (ncols in the tile).
inline __mmask16 group_mask(int ncols, int g) {
  const int valid = std::min(kLanes, ncols - kLanes * g);
  return static_cast<__mmask16>((1u << valid) - 1u);
}

}  // namespace tile512
}  // namespace agentx
