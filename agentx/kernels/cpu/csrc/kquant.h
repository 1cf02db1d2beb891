// What the two K-quant kernel files (qlinear_kquant.cpp: AVX2, qlinear_kquant_avx512.cpp:
// AVX-512 VNNI) share: the activation layout, the Q4_K scale unpacking, and the float steps
// that turn a super-block's exact integer sums into the output (the same code on both ISAs,
// so they give the same bits; kernels/ref/kquant.py defines the math).
//
// The float steps must be separate roundings: no multiply-add contraction in these files.
#pragma once
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "parallel.h"

namespace agentx {
namespace kquant {

constexpr int64_t kBlock = 256;
constexpr int64_t kQ4KBytes = 144;
constexpr int64_t kQ6KBytes = 210;
constexpr int kRows = 4;  // activation rows a pass over the weights

// Activations quantized per row and super-block: xq (M, K) int8, dx (M, K/256) float,
// sums (M, K/256, 16) int16 of xq per 16 features.
struct Rows {
  const int8_t* xq;
  const float* dx;
  const int16_t* sums;
  int64_t k;
  int64_t blocks;
};

// Q4_K's 12 scale bytes -> 8 6-bit scales and 8 6-bit mins.
inline void q4k_scales(const uint8_t* s, int16_t* sc, int16_t* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    m[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
    m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// sum_j m[j] * (xq sum of sub-block j of 32)
inline int32_t q4k_min_sum(const int16_t* m, const int16_t* sums) {
  int32_t s = 0;
  for (int j = 0; j < 8; ++j) s += m[j] * (sums[2 * j] + sums[2 * j + 1]);
  return s;
}

// sum_j sc[j] * (xq sum of sub-block j of 16)
inline int32_t q6k_offset_sum(const int8_t* sc, const int16_t* sums) {
  int32_t s = 0;
  for (int j = 0; j < 16; ++j) s += sc[j] * sums[j];
  return s;
}

inline float q4k_step(float acc, float dx, float d, float dmin, int32_t s1, int32_t s2) {
  const float a = d * static_cast<float>(s1);
  const float b = dmin * static_cast<float>(s2);
  const float t = a - b;
  const float p = dx * t;
  return acc + p;
}

inline float q6k_step(float acc, float dx, float d, int32_t s) {
  const float t = d * static_cast<float>(s);
  const float p = dx * t;
  return acc + p;
}

// ---- 8 columns a vector: the group paths of both kernel files (AVX2 instructions, which every
// CPU these kernels run on has; the AVX-512 file differs only in how it forms the sums) ----

// 8 vectors of 8 int32 -> one vector whose lane c is the sum of v[c] (exact in any order).
inline __m256i reduce8(const __m256i* v) {
  const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}

// Q4_K's 12 scale bytes -> sc and m as 8 bytes each (kquant::q4k_scales, 4 bytes at a time).
inline void q4k_scale_bytes(const uint8_t* s, uint64_t* sc, uint64_t* m) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  const uint32_t six = 0x3F3F3F3F, four = 0x0F0F0F0F, two = 0x03030303;
  const uint32_t sc_hi = (u[2] & four) | (((u[0] >> 6) & two) << 4);
  const uint32_t m_hi = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);
  *sc = (u[0] & six) | (static_cast<uint64_t>(sc_hi) << 32);
  *m = (u[1] & six) | (static_cast<uint64_t>(m_hi) << 32);
}

// Software prefetch of a block's cache lines (the 8 columns of a group are 8 streams, more
// than the hardware prefetcher follows well); never faults, even past the weight's end.
inline void prefetch_block(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes + 63; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
  }
}

// S2 of 8 columns (lane c: column c) of one row: the 8 min bytes of column c (mb[c]) against
// that row's 8 sums of 32 (x32, in both lanes), columns c and c + 4 in one madd.
inline __m256i min_sums8(const uint64_t* mb, __m256i x32) {
  __m256i v[4];
  for (int c = 0; c < 4; ++c) {
    const __m128i pair =
        _mm_set_epi64x(static_cast<int64_t>(mb[c + 4]), static_cast<int64_t>(mb[c]));
    v[c] = _mm256_madd_epi16(_mm256_cvtepu8_epi16(pair), x32);
  }
  // lane c of each half: [c c c c | c+4 ...] -> hadd twice -> [0 1 2 3 | 4 5 6 7]
  return _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
}

// One row's 8 sums of 32 features of a super-block (from its 16 sums of 16), in both lanes.
inline __m256i sums32(const int16_t* sums) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sums));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sums + 8));
  return _mm256_broadcastsi128_si256(_mm_hadd_epi16(lo, hi));  // |sum| <= 32 * 127: exact
}

// -32 * sum_j sc_j * sums_j of a Q6_K block as 8 int32 lanes (their total is the offset term).
inline __m256i q6k_offset8(const int8_t* sc, const int16_t* sums) {
  const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
  const __m256i sv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums));
  return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, sv), 5));
}

// q4k_step / q6k_step on 8 columns a vector: the same roundings in every lane.
inline __m256 q4k_step8(__m256 acc, float dx, __m256 d, __m256 dmin, __m256i s1, __m256i s2) {
  const __m256 a = _mm256_mul_ps(d, _mm256_cvtepi32_ps(s1));
  const __m256 b = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(s2));
  return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(dx), _mm256_sub_ps(a, b)));
}

inline __m256 q6k_step8(__m256 acc, float dx, __m256 d, __m256i s) {
  const __m256 t = _mm256_mul_ps(d, _mm256_cvtepi32_ps(s));
  return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(dx), t));
}

// ---- the GEMMs' unpacking (qlinear_kquant_gemm.cpp: AVX2, qlinear_kquant_gemm_avx512.cpp) ----

// A Q4_K block's 256 weights (0..15) as bytes, in feature order.
inline void q4k_weight_bytes(const uint8_t* blk, uint8_t* col) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {  // 32 bytes: low nibbles weights 64 j.., high ones 64 j + 32..
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * j));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(col + 64 * j), _mm256_and_si256(packed, low));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(col + 64 * j + 32),
                        _mm256_and_si256(_mm256_srli_epi16(packed, 4), low));
  }
}

// A Q6_K block's 256 weights (0..63, the -32 left to the offset sums) as bytes, in feature order.
inline void q6k_weight_bytes(const uint8_t* blk, uint8_t* col) {
  const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
  const __m256i mid = _mm256_set1_epi8(0x0C), top = _mm256_set1_epi8(0x30);
  auto load = [](const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  };
  auto store = [](uint8_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); };
  for (int h = 0; h < 2; ++h) {  // 128 weights: 64 low-nibble bytes, 32 bytes of 2-bit highs
    const __m256i l0 = load(blk + 64 * h), l1 = load(blk + 64 * h + 32);
    const __m256i qh = load(blk + 128 + 32 * h);
    uint8_t* q = col + 128 * h;
    store(q, _mm256_or_si256(_mm256_and_si256(l0, low),
                             _mm256_slli_epi16(_mm256_and_si256(qh, two), 4)));
    store(q + 32, _mm256_or_si256(_mm256_and_si256(l1, low),
                                  _mm256_slli_epi16(_mm256_and_si256(qh, mid), 2)));
    store(q + 64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                                  _mm256_and_si256(qh, top)));
    store(q + 96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                  _mm256_and_si256(_mm256_srli_epi16(qh, 2), top)));
  }
}

// 8 columns' bytes (cols[c], 256 each) -> 64 steps of 8 int32 lanes: step s at dst + s * stride
// holds weights 4 s .. 4 s + 3 of column c in lane c (an 8 x 8 transpose of int32 per 8 steps).
inline void interleave8(const uint8_t (*cols)[kBlock], uint8_t* dst, int64_t stride) {
  for (int s0 = 0; s0 < kBlock / 4; s0 += 8) {
    __m256i r[8], u[8];
    for (int c = 0; c < 8; ++c) {  // lane i: column c, step s0 + i
      r[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cols[c] + 4 * s0));
    }
    for (int h = 0; h < 8; h += 4) {
      const __m256i t0 = _mm256_unpacklo_epi32(r[h], r[h + 1]);
      const __m256i t1 = _mm256_unpackhi_epi32(r[h], r[h + 1]);
      const __m256i t2 = _mm256_unpacklo_epi32(r[h + 2], r[h + 3]);
      const __m256i t3 = _mm256_unpackhi_epi32(r[h + 2], r[h + 3]);
      u[h] = _mm256_unpacklo_epi64(t0, t2);      // steps 0 | 4 of columns h .. h + 3
      u[h + 1] = _mm256_unpackhi_epi64(t0, t2);  // steps 1 | 5
      u[h + 2] = _mm256_unpacklo_epi64(t1, t3);  // steps 2 | 6
      u[h + 3] = _mm256_unpackhi_epi64(t1, t3);  // steps 3 | 7
    }
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (s0 + i) * stride),
                          _mm256_permute2x128_si256(u[i], u[i + 4], 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (s0 + i + 4) * stride),
                          _mm256_permute2x128_si256(u[i], u[i + 4], 0x31));
    }
  }
}

// The GEMMs' drive: threads split the column tiles (tile_cols wide, the last one narrower) and
// run each tile's rows in chunks of row_chunk: run(tile, n0, ncols, m0, m1).
template <class Tile, class F>
void for_each_tile(int64_t n, int64_t m, int64_t tile_cols, int64_t row_chunk, const F& run) {
  parallel_for(0, (n + tile_cols - 1) / tile_cols, 1, [&](int64_t t0, int64_t t1) {
    Tile tile;
    for (int64_t i = t0; i < t1; ++i) {
      const int64_t n0 = i * tile_cols;
      const int ncols = static_cast<int>(std::min(tile_cols, n - n0));
      for (int64_t m0 = 0; m0 < m; m0 += row_chunk) {
        run(tile, n0, ncols, m0, std::min(m, m0 + row_chunk));
      }
    }
  });
}

// The next super-block (b + 1, `bytes` each) of columns [n0, n0 + ncols): strided streams
// (row_bytes apart) the hardware prefetcher does not follow when K is long (down: 5 KB apart).
inline void prefetch_next_block(const uint8_t* w, int64_t row_bytes, int64_t n0, int ncols,
                                int64_t b, int64_t bytes) {
  for (int c = 0; c < ncols; ++c) {
    const char* next = reinterpret_cast<const char*>(w + (n0 + c) * row_bytes + (b + 1) * bytes);
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
  }
}

// Rows [m0, m1) four at a time, then the 1-3 left: block(std::integral_constant<int, R>, r0).
template <class F>
inline void rows_by_4(int64_t m0, int64_t m1, const F& block) {
  int64_t r0 = m0;
  for (; r0 + 4 <= m1; r0 += 4) block(std::integral_constant<int, 4>{}, r0);
  switch (m1 - r0) {
    case 3: block(std::integral_constant<int, 3>{}, r0); break;
    case 2: block(std::integral_constant<int, 2>{}, r0); break;
    case 1: block(std::integral_constant<int, 1>{}, r0); break;
    default: break;
  }
}

// 8 fp16 values -> 8 floats.
inline __m256 half8(const uint16_t* h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

}  // namespace kquant
}  // namespace agentx
