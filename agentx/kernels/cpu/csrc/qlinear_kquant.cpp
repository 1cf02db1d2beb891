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
// every group of up to 4 rows (the 16 weight rows stay in L1/L2 across the row groups).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
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
void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* xq, float* dx, int16_t* sums) {
  const int64_t blocks = k / kBlock;
  at::parallel_for(0, m * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + i * kBlock;  // row i / blocks, block i % blocks
      float amax = 0.f;
      for (int64_t e = 0; e < kBlock; ++e) amax = std::max(amax, std::fabs(src[e]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      dx[i] = amax / 127.f;
      int8_t* dst = xq + i * kBlock;
      for (int j = 0; j < 16; ++j) {
        int s = 0;
        for (int e = 16 * j; e < 16 * j + 16; ++e) {
          const float prod = src[e] * inv;
          const int q = static_cast<int>(std::nearbyint(prod));  // round half to even
          dst[e] = static_cast<int8_t>(q);
          s += q;
        }
        sums[i * 16 + j] = static_cast<int16_t>(s);
      }
    }
  });
}

// S1 (sum_j sc_j q_j . x_j) of one Q4_K block against R rows' xq at this block.
template <int R>
inline void dot_q4k(const uint8_t* qs, const int16_t* sc, const int8_t* const* x, int32_t* s1) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    const __m256i lo = _mm256_and_si256(packed, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    const __m256i sl = _mm256_set1_epi16(sc[2 * c]), sh = _mm256_set1_epi16(sc[2 * c + 1]);
    for (int r = 0; r < R; ++r) {
      const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + 64 * c));
      const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + 64 * c + 32));
      // pairs <= 2 * 15 * 127 in 16 bits; times sc <= 63 and summed: far from int32's range
      const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), sl);
      const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), sh);
      acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(pl, ph));
    }
  }
  for (int r = 0; r < R; ++r) s1[r] = hsum(acc[r]);
}

// sum_j sc_j q_j . x_j (q unsigned 0..63, the -32 applied by the caller) of one Q6_K block.
template <int R>
inline void dot_q6k(const uint8_t* blk, const int8_t* sc, const int8_t* const* x, int32_t* s) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i two = _mm256_set1_epi8(0x03), mid = _mm256_set1_epi8(0x0C);
  const __m256i top = _mm256_set1_epi8(0x30);
  __m256i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
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
      const int c = 4 * h + t;  // chunk of 32: sub-blocks 2c, 2c + 1 (16 features each)
      const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[2 * c + 1]), _mm_set1_epi16(sc[2 * c]));
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + 32 * c));
        // pairs <= 2 * 63 * 127 < 2^15
        acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q[t], xv), scv));
      }
    }
  }
  for (int r = 0; r < R; ++r) s[r] = hsum(acc[r]);
}

// Columns [n0, n1) of R rows starting at row r0; y row r at y + r * ldy.
template <int R>
void columns_q4k(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Rows& a,
                 int64_t r0, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    float acc[R] = {};
    const uint8_t* blk = w + n * row_bytes;
    for (int64_t b = 0; b < a.blocks; ++b, blk += kquant::kQ4KBytes) {
      const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk));
      const float dmin = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2));
      int16_t sc[8], mn[8];
      kquant::q4k_scales(blk + 4, sc, mn);
      const int8_t* x[R];
      for (int r = 0; r < R; ++r) x[r] = a.xq + (r0 + r) * a.k + b * kBlock;
      int32_t s1[R];
      dot_q4k<R>(blk + 16, sc, x, s1);
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
void columns_q6k(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Rows& a,
                 int64_t r0, float* y, int64_t ldy) {
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

template <int R>
void columns_avx2(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                  const Rows& a, int64_t r0, float* y, int64_t ldy) {
  if (type == kQ4K) {
    columns_q4k<R>(w, row_bytes, n0, n1, a, r0, y, ldy);
  } else {
    columns_q6k<R>(w, row_bytes, n0, n1, a, r0, y, ldy);
  }
}

void columns(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
             const Rows& a, int64_t r0, int64_t rows, float* y, int64_t ldy) {
  if (kernel_isa(-1) == kIsaAvx512) {
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
  std::vector<int8_t> xq(m * k);
  std::vector<float> dx(m * blocks);
  std::vector<int16_t> sums(m * blocks * 16);
  quantize_rows(x, m, k, xq.data(), dx.data(), sums.data());
  const Rows a{xq.data(), dx.data(), sums.data(), k, blocks};
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  constexpr int64_t kCols = 16;
  at::parallel_for(0, (n + kCols - 1) / kCols, 1, [&](int64_t c0, int64_t c1) {
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
