// GGUF K-quant linear layers (Q4_K, Q6_K) multiplied in place, for AVX2 CPUs.
//
// The weight stays as the file's super-blocks of 256 input features (qweight (N, K/256 *
// block bytes) uint8; layouts in kernels/ref/kquant.py). Each activation row is quantized per
// super-block to int8 (one float scale dx, sums of xq per 16), each (row, column, super-block)
// gives exact int32 sums, and kquant.h's float steps fold them into the output in block order:
//
//   Q4_K  y += dx * (d * S1 - dmin * S2)   S1 = sum_j sc_j (q_j . xq_j), S2 = sum_j m_j sum(xq_j)
//   Q6_K  y += dx * (d * S)                S  = sum_j sc_j ((q_j - 32) . xq_j)
//
// Every output element depends on its own row alone, in a fixed order, so results do not depend
// on batching, threads or the ISA (qlinear_kquant_avx512.cpp: the same sums and steps).
//
// Work split: threads take ranges of output columns; inside, 16 columns at a time are swept by
// every group of up to 4 rows (the 16 weight rows stay in L1/L2 across the row groups). AVX2
// takes 8 columns together, decode's single row included (one horizontal sum for 8 columns, the
// float steps 8 lanes wide, the next 8 columns' blocks prefetched: ~1.6x at one row, one thread,
// over one column at a time); a remainder of fewer than 8 columns goes one column at a time: the
// same integers and roundings either way.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "kquant.h"

namespace agentx {
namespace {

using kquant::kBlock;
using kquant::kRows;
using kquant::Rows;

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Per row and super-block: dx = amax / 127, xq = rint(x * 127 / amax), sums of xq per 16.
// Vectorized, with the scalar definition's roundings: one product x * inv per element, rounded
// to the nearest integer, ties to even (cvtps2dq in the default rounding mode, as nearbyint).
void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* xq, float* dx, int16_t* sums) {
  const int64_t blocks = k / kBlock;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  parallel_for(0, m * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + i * kBlock;  // row i / blocks, block i % blocks
      __m256 vmax = _mm256_setzero_ps();
      for (int64_t e = 0; e < kBlock; e += 8) {
        vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(src + e), abs_mask));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      dx[i] = amax / 127.f;
      const __m256 vinv = _mm256_set1_ps(inv);
      int8_t* dst = xq + i * kBlock;
      for (int j = 0; j < 16; ++j) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + 16 * j), vinv));
        const __m256i b =
            _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + 16 * j + 8), vinv));
        // |q| <= 127: the saturating packs are exact; permute undoes packs' lane interleave
        const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
        const __m128i p8 =
            _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * j), p8);
        sums[i * 16 + j] = static_cast<int16_t>(hsum(_mm256_add_epi32(a, b)));
      }
    }
  });
}

// The byte-shuffle control that copies 16-bit element j of each 128-bit lane across the lane.
inline __m256i pick16(int j) {
  return _mm256_set1_epi16(static_cast<int16_t>((2 * j) | ((2 * j + 1) << 8)));
}

// sum_j sc_j (q_j . x_j) of R rows against one Q4_K block's quants, before the horizontal sum;
// sc16: the 8 scales as int16 in both 128-bit lanes.
template <int R>
inline void block_q4k_s1(const uint8_t* blk, __m256i sc16, const int8_t* const* x, __m256i* s1) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int r = 0; r < R; ++r) s1[r] = _mm256_setzero_si256();
  const uint8_t* qs = blk + 16;
  for (int c = 0; c < 4; ++c) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    const __m256i lo = _mm256_and_si256(packed, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    const __m256i sl = _mm256_shuffle_epi8(sc16, pick16(2 * c));
    const __m256i sh = _mm256_shuffle_epi8(sc16, pick16(2 * c + 1));
    for (int r = 0; r < R; ++r) {
      const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + 64 * c));
      const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + 64 * c + 32));
      const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), sl);
      const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), sh);
      s1[r] = _mm256_add_epi32(s1[r], _mm256_add_epi32(pl, ph));
    }
  }
}

// 8 unsigned bytes -> 8 int16, in both 128-bit lanes.
inline __m256i widen8(uint64_t bytes) {
  const __m128i b = _mm_cvtsi64_si128(static_cast<int64_t>(bytes));
  return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(b));
}

// The per-block integer sums of R rows against one Q4_K block, before the horizontal sum.
template <int R>
inline void block_q4k(const uint8_t* blk, const int8_t* const* x, const int16_t* const* sums,
                      __m256i* s1, __m256i* s2) {
  uint64_t scb, mb;
  kquant::q4k_scale_bytes(blk + 4, &scb, &mb);
  block_q4k_s1<R>(blk, widen8(scb), x, s1);
  // each min twice: once for each 16-feature sum of its 32-feature sub-block
  const __m128i m8 = _mm_cvtsi64_si128(static_cast<int64_t>(mb));
  const __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
  for (int r = 0; r < R; ++r) {
    const __m256i sv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums[r]));
    s2[r] = _mm256_madd_epi16(m16, sv);
  }
}

// sum_j sc_j ((q_j - 32) . x_j) of R rows against one Q6_K block, before the horizontal sum.
template <int R>
inline void block_q6k(const uint8_t* blk, const int8_t* const* x, const int16_t* const* sums,
                      __m256i* s) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i two = _mm256_set1_epi8(0x03), mid = _mm256_set1_epi8(0x0C);
  const __m256i top = _mm256_set1_epi8(0x30);
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
  const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
  // scales 0..7 and 8..15 as int16 in both lanes: chunk c's two scales by one shuffle
  const __m128i sc_hi = _mm_srli_si128(sc8, 8);
  const __m256i half[2] = {_mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc8)),
                           _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc_hi))};
  for (int r = 0; r < R; ++r) {
    const __m256i sv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums[r]));
    s[r] = _mm256_sub_epi32(_mm256_setzero_si256(),
                            _mm256_slli_epi32(_mm256_madd_epi16(sc16, sv), 5));  // -32 sc.sum
  }
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
    for (int t = 0; t < 4; ++t) {
      const int c = 4 * h + t;
      // sc[2c] (element 2t of half h) across the low lane, sc[2c + 1] across the high one
      const __m256i pick = _mm256_set_m128i(_mm256_castsi256_si128(pick16(2 * t + 1)),
                                            _mm256_castsi256_si128(pick16(2 * t)));
      const __m256i scv = _mm256_shuffle_epi8(half[h], pick);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + 32 * c));
        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q[t], xv), scv));
      }
    }
  }
}

// 8 columns [n, n + 8) of R rows: the integer sums of the 8 columns are summed across lanes
// together, then kquant.h's float steps run on 8 columns a vector (the same roundings a lane).
template <int R>
void group_q4k(const uint8_t* w, int64_t row_bytes, int64_t n, const Rows& a, int64_t r0,
               float* y, int64_t ldy) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* col = w + n * row_bytes;
  for (int64_t b = 0; b < a.blocks; ++b, col += kquant::kQ4KBytes) {
    const int8_t* x[R];
    for (int r = 0; r < R; ++r) x[r] = a.xq + (r0 + r) * a.k + b * kBlock;
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
      __m256i v1[R];
      block_q4k_s1<R>(blk, widen8(scb), x, v1);
      for (int r = 0; r < R; ++r) s1[r][c] = v1[r];
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
void group_q6k(const uint8_t* w, int64_t row_bytes, int64_t n, const Rows& a, int64_t r0,
               float* y, int64_t ldy) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const int8_t* x[R];
    const int16_t* sums[R];
    for (int r = 0; r < R; ++r) {
      x[r] = a.xq + (r0 + r) * a.k + b * kBlock;
      sums[r] = a.sums + ((r0 + r) * a.blocks + b) * 16;
    }
    __m256i s[R][8];
    uint16_t dh[8];
    for (int c = 0; c < 8; ++c) {
      const uint8_t* blk = w + (n + c) * row_bytes + b * kquant::kQ6KBytes;
      kquant::prefetch_block(blk + 8 * row_bytes, kquant::kQ6KBytes);
      std::memcpy(&dh[c], blk + 208, 2);
      __m256i v[R];
      block_q6k<R>(blk, x, sums, v);
      for (int r = 0; r < R; ++r) s[r][c] = v[r];
    }
    const __m256 d = kquant::half8(dh);
    for (int r = 0; r < R; ++r) {
      acc[r] = kquant::q6k_step8(acc[r], a.dx[(r0 + r) * a.blocks + b], d, kquant::reduce8(s[r]));
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy + n, acc[r]);
}

// Columns [n0, n1) of R rows starting at row r0, one column at a time; y row r at y + r * ldy.
template <int R>
void columns_q4k(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Rows& a,
                 int64_t r0, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    float acc[R] = {};
    const uint8_t* blk = w + n * row_bytes;
    for (int64_t b = 0; b < a.blocks; ++b, blk += kquant::kQ4KBytes) {
      const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk));
      const float dmin = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2));
      const int8_t* x[R];
      const int16_t* sums[R];
      for (int r = 0; r < R; ++r) {
        x[r] = a.xq + (r0 + r) * a.k + b * kBlock;
        sums[r] = a.sums + ((r0 + r) * a.blocks + b) * 16;
      }
      __m256i v1[R], v2[R];
      block_q4k<R>(blk, x, sums, v1, v2);
      for (int r = 0; r < R; ++r) {
        const float dx = a.dx[(r0 + r) * a.blocks + b];
        acc[r] = kquant::q4k_step(acc[r], dx, d, dmin, hsum(v1[r]), hsum(v2[r]));
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = acc[r];
  }
}

template <int R>
void columns_q6k(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Rows& a,
                 int64_t r0, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    float acc[R] = {};
    const uint8_t* blk = w + n * row_bytes;
    for (int64_t b = 0; b < a.blocks; ++b, blk += kquant::kQ6KBytes) {
      const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 208));
      const int8_t* x[R];
      const int16_t* sums[R];
      for (int r = 0; r < R; ++r) {
        x[r] = a.xq + (r0 + r) * a.k + b * kBlock;
        sums[r] = a.sums + ((r0 + r) * a.blocks + b) * 16;
      }
      __m256i v[R];
      block_q6k<R>(blk, x, sums, v);
      for (int r = 0; r < R; ++r) {
        acc[r] = kquant::q6k_step(acc[r], a.dx[(r0 + r) * a.blocks + b], d, hsum(v[r]));
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = acc[r];
  }
}

template <int R>
void columns_avx2(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                  const Rows& a, int64_t r0, float* y, int64_t ldy) {
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

void columns(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
             const Rows& a, int64_t r0, int64_t rows, float* y, int64_t ldy) {
  if (kernel_isa(-1) >= kIsaAvx512) {
    kquant_columns_avx512(type, w, row_bytes, n0, n1, a.xq, a.dx, a.sums, a.k, r0, rows, y, ldy);
    return;
  }
  float* yr = y + r0 * ldy;
  switch (rows) {
    case 4: columns_avx2<4>(type, w, row_bytes, n0, n1, a, r0, yr, ldy); break;
    case 3: columns_avx2<3>(type, w, row_bytes, n0, n1, a, r0, yr, ldy); break;
    case 2: columns_avx2<2>(type, w, row_bytes, n0, n1, a, r0, yr, ldy); break;
    default: columns_avx2<1>(type, w, row_bytes, n0, n1, a, r0, yr, ldy); break;
  }
}

// Buffers for quantize_rows' output, grown to fit and never shrunk.
struct Activations {
  std::vector<int8_t> xq;
  std::vector<float> dx;
  std::vector<int16_t> sums;

  void fit(int64_t m, int64_t k) {
    const size_t rows = static_cast<size_t>(m), cols = static_cast<size_t>(k);
    const size_t blocks = cols / kBlock;
    if (xq.size() < rows * cols) xq.resize(rows * cols);
    if (dx.size() < rows * blocks) dx.resize(rows * blocks);
    if (sums.size() < rows * blocks * 16) sums.resize(rows * blocks * 16);
  }
};

int64_t type_bytes(int64_t type) {
  TORCH_CHECK(type == kQ4K || type == kQ6K, "kquant_linear: type must be Q4_K (12) or Q6_K (14)");
  return type == kQ4K ? kquant::kQ4KBytes : kquant::kQ6KBytes;
}

}  // namespace

void kquant_linear_into(const float* x, int64_t m, int64_t k, const at::Tensor& qweight,
                        int64_t type, float* y, int64_t ldy) {
  TORCH_CHECK(k % kBlock == 0, "kquant_linear: in_features must be a multiple of 256");
  const int64_t blocks = k / kBlock, row_bytes = blocks * type_bytes(type);
  TORCH_CHECK(qweight.dim() == 2 && qweight.size(1) == row_bytes && qweight.is_contiguous() &&
                  qweight.scalar_type() == at::kByte,
              "kquant_linear: qweight must be contiguous (N, K/256 * block bytes) uint8");
  if (m == 0) return;
  const int64_t n = qweight.size(0);
  // the quantized activations: a few rows (decode, drafts) reuse the calling thread's buffers
  thread_local Activations few;
  Activations many;
  Activations& act = m <= kRows ? few : many;
  act.fit(m, k);
  quantize_rows(x, m, k, act.xq.data(), act.dx.data(), act.sums.data());
  const Rows a{act.xq.data(), act.dx.data(), act.sums.data(), k, blocks};
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  // Many rows: each super-block unpacked once for all of them (qlinear_kquant_gemm*.cpp, the
  // same bits).
  const int64_t isa = kernel_isa(-1);
  if (isa == kIsaAmx && m >= kKquantGemmRowsAmx) {
    kquant_gemm_amx(type, w, row_bytes, n, a.xq, a.dx, a.sums, k, m, y, ldy);
    return;
  }
  const bool avx512 = isa >= kIsaAvx512;
  if (m >= (avx512 ? kKquantGemmRowsAvx512 : kKquantGemmRows)) {
    if (avx512) {
      kquant_gemm_avx512(type, w, row_bytes, n, a.xq, a.dx, a.sums, k, m, y, ldy);
    } else {
      kquant_gemm_avx2(type, w, row_bytes, n, a.xq, a.dx, a.sums, k, m, y, ldy);
    }
    return;
  }
  constexpr int64_t kCols = 16;
  parallel_for(0, (n + kCols - 1) / kCols, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * kCols, n1 = std::min(n, n0 + kCols);
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        columns(type, w, row_bytes, n0, n1, a, r0, std::min<int64_t>(kRows, m - r0), y, ldy);
      }
    }
  });
}

namespace {

// x (M, K) float32 -> (M, N) float32.
at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t type,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x must be (M, K) float32");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), n = qweight.size(0);
  at::Tensor y = at::empty({m, n}, xc.options());
  kquant_linear_into(xc.data_ptr<float>(), m, xc.size(1), qweight, type, y.data_ptr<float>(), n);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(agentx, lib) {
  lib.def("kquant_linear(Tensor x, Tensor qweight, int type, Tensor? bias) -> Tensor");
  lib.impl("kquant_linear", c10::DispatchKey::CPU, &kquant_linear);
}

}  // namespace agentx
