// The K-quant columns of qlinear_kquant.cpp for AVX-512 VNNI CPUs: 64 weight bytes a zmm
// register and vpdpbusd (4 byte products a 32-bit lane) where AVX2 needs maddubs + madd.
//
// Each super-block's integer sums are exact on both ISAs and kquant.h's float steps are shared,
// so the results equal the AVX2 kernel's bit for bit; this is only faster.
//
//   Q4_K  zmm bytes 0..31 = qs chunk 2p, 32..63 = chunk 2p + 1 (one 64-byte load); the low
//         nibbles meet x[128p .. +32 | 128p + 64 .. +32], the high ones x[128p + 32 .. | +96 ..]
//   Q6_K  two 32-byte chunks (c, c + 1) of rebuilt 6-bit values meet x[32c .. 32c + 64]; a
//         32-bit lane covers 4 features, so 4 lanes share a scale of 16 features
#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "kquant.h"

#define AGENTX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq")))

namespace agentx {
namespace {

using kquant::kBlock;
using kquant::Rows;

AGENTX_AVX512 inline __m512i load_halves(const int8_t* a, const int8_t* b) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// A row's activations of one super-block as the 4 vectors Q4_K's nibbles meet (see the top).
AGENTX_AVX512 inline void load_x_q4k(const int8_t* x, __m512i* xv) {
  for (int p = 0; p < 2; ++p) {
    xv[2 * p] = load_halves(x + 128 * p, x + 128 * p + 64);
    xv[2 * p + 1] = load_halves(x + 128 * p + 32, x + 128 * p + 96);
  }
}

// Lanes 0..7 = scale a, lanes 8..15 = scale b of a vector whose lane j holds scale j.
AGENTX_AVX512 inline __m512i pick_halves(__m512i scales, int a, int b) {
  const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi32(a), _mm256_set1_epi32(b), 1);
  return _mm512_permutexvar_epi32(idx, scales);
}

// sum_j sc_j (q_j . x_j) of R rows against one Q4_K block's quants, before the horizontal sum.
// scb: the 8 6-bit scales as bytes; xv: R rows of load_x_q4k. A dpbusd lane (4 products of at
// most 15 * 127) fits in 16 bits, so dpwssd against the scale (high 16 bits zero) multiplies and
// accumulates it exactly in one instruction.
template <int R>
AGENTX_AVX512 inline void sums_q4k(const uint8_t* qs, uint64_t scb, const __m512i (*xv)[4],
                                   __m512i* acc) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i zero = _mm512_setzero_si512();
  const __m512i sc = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(scb)));
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  for (int p = 0; p < 2; ++p) {
    const __m512i packed = _mm512_loadu_si512(qs + 64 * p);
    const __m512i lo = _mm512_and_si512(packed, low);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    const __m512i sl = pick_halves(sc, 4 * p, 4 * p + 2);
    const __m512i sh = pick_halves(sc, 4 * p + 1, 4 * p + 3);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_dpbusd_epi32(zero, lo, xv[r][2 * p]), sl);
      acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_dpbusd_epi32(zero, hi, xv[r][2 * p + 1]), sh);
    }
  }
}

template <int R>
AGENTX_AVX512 inline void dot_q4k(const uint8_t* qs, uint64_t scb, const int8_t* const* x,
                                  int32_t* s1) {
  __m512i xv[R][4], acc[R];
  for (int r = 0; r < R; ++r) load_x_q4k(x[r], xv[r]);
  sums_q4k<R>(qs, scb, xv, acc);
  for (int r = 0; r < R; ++r) s1[r] = _mm512_reduce_add_epi32(acc[r]);
}

// sum_j sc_j (q_j . x_j) of R rows against one Q6_K block (the -32 offset not yet taken), before
// the horizontal sum.
template <int R>
AGENTX_AVX512 inline void sums_q6k(const uint8_t* blk, const int8_t* sc, const int8_t* const* x,
                                   __m512i* acc) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i two = _mm256_set1_epi8(0x03), mid = _mm256_set1_epi8(0x0C);
  const __m256i top = _mm256_set1_epi8(0x30);
  const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i zero = _mm512_setzero_si512();
  const __m512i mask16 = _mm512_set1_epi32(0xFFFF);
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = blk + 64 * h;
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    __m256i q[4];
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, low),
                           _mm256_slli_epi16(_mm256_and_si256(qh, two), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, low),
                           _mm256_slli_epi16(_mm256_and_si256(qh, mid), 2));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                           _mm256_and_si256(qh, top));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), top));
    for (int pp = 0; pp < 2; ++pp) {
      const int c = 4 * h + 2 * pp;  // chunks c, c + 1: sub-blocks 2c .. 2c + 3
      const __m512i qz = _mm512_inserti64x4(_mm512_castsi256_si512(q[2 * pp]), q[2 * pp + 1], 1);
      int32_t four;
      std::memcpy(&four, sc + 2 * c, 4);
      // the signed scale in each lane's low 16 bits, zeros above (see sums_q4k: a lane of 4
      // products of at most 63 * 127 fits in 16 bits)
      const __m512i scv = _mm512_and_si512(
          _mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(four), spread)), mask16);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_loadu_si512(x[r] + 32 * c);
        acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_dpbusd_epi32(zero, qz, xv), scv);
      }
    }
  }
}

template <int R>
AGENTX_AVX512 inline void dot_q6k(const uint8_t* blk, const int8_t* sc, const int8_t* const* x,
                                  int32_t* s) {
  __m512i acc[R];
  sums_q6k<R>(blk, sc, x, acc);
  for (int r = 0; r < R; ++r) s[r] = _mm512_reduce_add_epi32(acc[r]);
}

// 16 int32 lanes -> 8 whose total is the same (exact).
AGENTX_AVX512 inline __m256i fold(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

// 8 columns [n, n + 8) of R rows, as qlinear_kquant.cpp's group_q4k / group_q6k: each column's
// sums by VNNI, then the 8 columns' horizontal sums and kquant.h's float steps together.
template <int R>
AGENTX_AVX512 void group_q4k(const uint8_t* w, int64_t row_bytes, int64_t n, const Rows& a,
                             int64_t r0, float* y, int64_t ldy) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* col = w + n * row_bytes;
  for (int64_t b = 0; b < a.blocks; ++b, col += kquant::kQ4KBytes) {
    __m512i xv[R][4];
    for (int r = 0; r < R; ++r) load_x_q4k(a.xq + (r0 + r) * a.k + b * kBlock, xv[r]);
    __m256i s1[R][8];
    uint64_t mb[8];
    uint16_t dh[8], mh[8];
    for (int c = 0; c < 8; ++c) {
      const uint8_t* blk = col + c * row_bytes;
      kquant::prefetch_block(blk + 8 * row_bytes, kquant::kQ4KBytes);  // the next group's block
      std::memcpy(&dh[c], blk, 2);
      std::memcpy(&mh[c], blk + 2, 2);
      uint64_t scb;
      kquant::q4k_scale_bytes(blk + 4, &scb, &mb[c]);
      __m512i v[R];
      sums_q4k<R>(blk + 16, scb, xv, v);
      for (int r = 0; r < R; ++r) s1[r][c] = fold(v[r]);
    }
    const __m256 d = kquant::half8(dh), dmin = kquant::half8(mh);
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * a.blocks + b;
      const __m256i s2 = kquant::min_sums8(mb, kquant::sums32(a.sums + rb * 16));
      acc[r] = kquant::q4k_step8(acc[r], a.dx[rb], d, dmin, kquant::reduce8(s1[r]), s2);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy + n, acc[r]);
}

template <int R>
AGENTX_AVX512 void group_q6k(const uint8_t* w, int64_t row_bytes, int64_t n, const Rows& a,
                             int64_t r0, float* y, int64_t ldy) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const int8_t* x[R];
    for (int r = 0; r < R; ++r) x[r] = a.xq + (r0 + r) * a.k + b * kBlock;
    __m256i s[R][8];
    uint16_t dh[8];
    for (int c = 0; c < 8; ++c) {
      const uint8_t* blk = w + (n + c) * row_bytes + b * kquant::kQ6KBytes;
      kquant::prefetch_block(blk + 8 * row_bytes, kquant::kQ6KBytes);
      std::memcpy(&dh[c], blk + 208, 2);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      __m512i v[R];
      sums_q6k<R>(blk, sc, x, v);
      for (int r = 0; r < R; ++r) {
        const int16_t* sums = a.sums + ((r0 + r) * a.blocks + b) * 16;
        s[r][c] = _mm256_add_epi32(fold(v[r]), kquant::q6k_offset8(sc, sums));
      }
    }
    const __m256 d = kquant::half8(dh);
    for (int r = 0; r < R; ++r) {
      acc[r] = kquant::q6k_step8(acc[r], a.dx[(r0 + r) * a.blocks + b], d, kquant::reduce8(s[r]));
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy + n, acc[r]);
}

template <int R>
AGENTX_AVX512 void columns_q4k(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                               const Rows& a, int64_t r0, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    float acc[R] = {};
    const uint8_t* blk = w + n * row_bytes;
    for (int64_t b = 0; b < a.blocks; ++b, blk += kquant::kQ4KBytes) {
      const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk));
      const float dmin = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2));
      int16_t sc[8], mn[8];
      kquant::q4k_scales(blk + 4, sc, mn);
      uint64_t scb, mb;
      kquant::q4k_scale_bytes(blk + 4, &scb, &mb);
      const int8_t* x[R];
      for (int r = 0; r < R; ++r) x[r] = a.xq + (r0 + r) * a.k + b * kBlock;
      int32_t s1[R];
      dot_q4k<R>(blk + 16, scb, x, s1);
      for (int r = 0; r < R; ++r) {
        const int64_t rb = (r0 + r) * a.blocks + b;
        const int32_t s2 = kquant::q4k_min_sum(mn, a.sums + rb * 16);
        acc[r] = kquant::q4k_step(acc[r], a.dx[rb], d, dmin, s1[r], s2);
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = acc[r];
  }
}

template <int R>
AGENTX_AVX512 void columns_q6k(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                               const Rows& a, int64_t r0, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    float acc[R] = {};
    const uint8_t* blk = w + n * row_bytes;
    for (int64_t b = 0; b < a.blocks; ++b, blk += kquant::kQ6KBytes) {
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 208));
      const int8_t* x[R];
      for (int r = 0; r < R; ++r) x[r] = a.xq + (r0 + r) * a.k + b * kBlock;
      int32_t s[R];
      dot_q6k<R>(blk, sc, x, s);
      for (int r = 0; r < R; ++r) {
        const int64_t rb = (r0 + r) * a.blocks + b;
        const int32_t off = kquant::q6k_offset_sum(sc, a.sums + rb * 16);
        acc[r] = kquant::q6k_step(acc[r], a.dx[rb], d, s[r] - 32 * off);
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = acc[r];
  }
}

// 8 columns a group while 8 remain, then the rest one column at a time (the same bits).
template <int R>
AGENTX_AVX512 void columns(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n0,
                           int64_t n1, const Rows& a, int64_t r0, float* y, int64_t ldy) {
  int64_t n = n0;
  for (; n + 8 <= n1; n += 8) {
    if (type == kQ4K) {
      group_q4k<R>(w, row_bytes, n, a, r0, y, ldy);
    } else {
      group_q6k<R>(w, row_bytes, n, a, r0, y, ldy);
    }
  }
  if (type == kQ4K) {
    columns_q4k<R>(w, row_bytes, n, n1, a, r0, y, ldy);
  } else {
    columns_q6k<R>(w, row_bytes, n, n1, a, r0, y, ldy);
  }
}

}  // namespace

AGENTX_AVX512 void kquant_columns_avx512(int64_t type, const uint8_t* w, int64_t row_bytes,
                                         int64_t n0, int64_t n1, const int8_t* xq,
                                         const float* dx, const int16_t* sums, int64_t k,
                                         int64_t r0, int64_t rows, float* y, int64_t ldy) {
  const Rows a{xq, dx, sums, k, k / kBlock};
  float* yr = y + r0 * ldy;
  switch (rows) {
    case 4: columns<4>(type, w, row_bytes, n0, n1, a, r0, yr, ldy); break;
    case 3: columns<3>(type, w, row_bytes, n0, n1, a, r0, yr, ldy); break;
    case 2: columns<2>(type, w, row_bytes, n0, n1, a, r0, yr, ldy); break;
    default: columns<1>(type, w, row_bytes, n0, n1, a, r0, yr, ldy); break;
  }
}

}  // namespace agentx
