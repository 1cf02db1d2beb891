// What the two K-quant kernel files (qlinear_kquant.cpp: AVX2, qlinear_kquant_avx512.cpp:
// AVX-512 VNNI) share: the activation layout, the Q4_K scale unpacking, and the float steps
// that turn a super-block's exact integer sums into the output (the same code on both ISAs,
// so they give the same bits; kernels/ref/kquant.py defines the math).
//
// The float steps must be separate roundings: no multiply-add contraction in these files.
#pragma once
#pragma GCC optimize("fp-contract=off")

#include <cstdint>

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

}  // namespace kquant
}  // namespace agentx
