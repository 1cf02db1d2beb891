// What the quantized linear kernels share across files and instruction sets: the packed
// layout's constants (qlinear.cpp describes the layout), the activation broadcast, and the
// target attribute that compiles a function for AVX-512 VNNI inside a file built for AVX2.
//
// Both ISAs' kernels read the same layout with the same constants, so they stay one layout:
// change a constant here and every kernel (and kernels/ref/quant.py's GROUP / TILE) follows.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

// A function compiled for AVX-512 VNNI (called only after kernel_isa chose it at run time).
#ifndef AGENTX_AVX512
#define AGENTX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq")))
#endif

namespace agentx {
namespace qlinear {

constexpr int64_t kGroup = 32;  // input features sharing one scale (and min)
constexpr int64_t kTile = 8;    // output columns a packed tile holds: one per 32-bit lane
constexpr int kRows = 4;        // activation rows one pass over a tile's weights serves
// rows one pass over an AVX-512 pair of tiles serves: 6 (31 of the 32 zmm registers for int4)
// ran 0-2% faster than 4 on Zen 4's int4 layers at 16-512 rows, its int8 LM head 2-11%
constexpr int kRowsWide = 6;

// Bytes of one packed tile over k input features: int4 packs two weights a byte.
inline int64_t tile_bytes(bool int4, int64_t k) { return int4 ? k * kTile / 2 : k * kTile; }

// The 4 int8 activations at p in every 32-bit lane (each lane then meets its column's 4
// weights of the same features).
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

AGENTX_AVX512 inline __m512i bcast4_avx512(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

}  // namespace qlinear
}  // namespace agentx
