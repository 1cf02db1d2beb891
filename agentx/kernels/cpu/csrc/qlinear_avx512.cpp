// The quantized linear tiles of qlinear.cpp for AVX-512 VNNI CPUs: the same packed layout,
// two 8-column tiles a zmm register, and one vpdpbusd where AVX2 needs maddubs + madd.
//
// Every integer dot product of a group is exact in both versions and the float steps per
// column are the same operations in the same order, so the results equal the AVX2 kernel's bit
// for bit (tests/kernels/test_kernels_cpu.py checks it); this is only faster.
//
//   zmm lanes 0..7  = tile t    (columns 8t .. 8t + 7)
//   zmm lanes 8..15 = tile t+1  (columns 8t + 8 .. 8t + 15)
//
// vpdpbusd multiplies unsigned by signed bytes. int4 weights are unsigned (0..15) and the
// activations signed; int8 weights are signed, so they go in offset by 128 (w ^ 0x80 as
// unsigned: one XOR a load) and 128 * sum(x) of the row's group, computed once a call, comes off
// the integer sum again: the same exact integer dot. (Offsetting the activations instead needs
// 128 * sum(w) of every column: a vpdpbusd a load, a fifth of the multiplies at 4 rows a pass.)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"
#include "qlinear_common.h"

namespace agentx {
namespace {

using qlinear::kGroup;
using qlinear::kTile;
using qlinear::bcast4_avx512;

// 32 bytes of tile t and 32 of tile t + 1, `tile_stride` bytes apart
AGENTX_AVX512 inline __m512i load_pair(const uint8_t* p, int64_t tile_stride) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + tile_stride));
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

AGENTX_AVX512 inline __m512 load_pair_ps(const float* p, int64_t tile_stride) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p)),
                            _mm256_loadu_ps(p + tile_stride), 1);
}

// The weights of tiles a pass will read (their packed bytes, scales and mins: three runs; its
// part of the next sub-block or block, qlinear.cpp), brought into the caches a few lines a group
// of the tiles being read. A thread's four tiles at a time are twelve short streams (2.3 KB each
// at K = 576) that the hardware prefetcher hardly starts on before they end; a decode step's
// GEMMs find their weights in DRAM, the KV read since the layer before having evicted them
// (8 rows x 30 SmolLM2 layers between attention calls: 6.9-7.3 -> 6.2-6.5 ms, 3 alternated
// rounds, Zen 4).
struct Ahead {
  const char* p[3] = {nullptr, nullptr, nullptr};
  int64_t bytes[3] = {0, 0, 0};
  int64_t per_group[3] = {0, 0, 0};  // lines a group
  bool to_l2 = false;  // T1, else T0

  AGENTX_AVX512 __attribute__((always_inline)) inline void step(int64_t g) const {
    for (int s = 0; s < 3; ++s) {
      for (int64_t i = g * per_group[s]; i < (g + 1) * per_group[s] && 64 * i < bytes[s]; ++i) {
        if (to_l2) {
          _mm_prefetch(p[s] + 64 * i, _MM_HINT_T1);
        } else {
          _mm_prefetch(p[s] + 64 * i, _MM_HINT_T0);
        }
      }
    }
  }
};

// R rows x C pairs of tiles (16 C columns), int4 weights; out[r] gets 16 C floats.
template <int R, int C>
AGENTX_AVX512 void pairs_int4(const uint8_t* w, int64_t tile_bytes, const float* scale,
                              const float* mins, int64_t tile_floats, const int8_t* xq,
                              const float* dx, const float* sx, int64_t k, float* const* out,
                              const Ahead* ahead) {
  const int64_t groups = k / kGroup;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    if (ahead != nullptr) ahead->step(g);
    __m512i isum[R][C];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) isum[r][c] = _mm512_setzero_si512();
    }
    for (int o = 0; o < 4; ++o) {
      __m512i lo[C], hi[C];
      for (int c = 0; c < C; ++c) {
        const __m512i packed = load_pair(w + 2 * c * tile_bytes + (g * 4 + o) * 32, tile_bytes);
        lo[c] = _mm512_and_si512(packed, low);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * k + g * kGroup + o * 8;
        const __m512i x0 = bcast4_avx512(xr), x1 = bcast4_avx512(xr + 4);
        for (int c = 0; c < C; ++c) {
          isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], lo[c], x0);
          isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], hi[c], x1);
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m512 d = load_pair_ps(scale + 2 * c * tile_floats + g * kTile, tile_floats);
      const __m512 m = load_pair_ps(mins + 2 * c * tile_floats + g * kTile, tile_floats);
      for (int r = 0; r < R; ++r) {
        const int64_t rg = r * groups + g;
        const __m512 dot = _mm512_cvtepi32_ps(isum[r][c]);
        acc[r][c] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(dx[rg])), acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[rg]), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[r] + 16 * c, acc[r][c]);
  }
}

// R rows x C pairs of tiles, int8 weights; xsum: 128 * the sum of each row's group of xq.
template <int R, int C>
AGENTX_AVX512 void pairs_int8(const uint8_t* w, int64_t tile_bytes, const float* scale,
                              int64_t tile_floats, const int8_t* xq, const int32_t* xsum,
                              const float* dx, int64_t k, float* const* out, const Ahead* ahead) {
  const int64_t groups = k / kGroup;
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    if (ahead != nullptr) ahead->step(g);
    __m512i isum[R][C];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) isum[r][c] = _mm512_setzero_si512();
    }
    for (int u = 0; u < 8; ++u) {
      __m512i wu[C];  // w + 128, unsigned
      for (int c = 0; c < C; ++c) {
        wu[c] = _mm512_xor_si512(
            load_pair(w + 2 * c * tile_bytes + (g * 8 + u) * 32, tile_bytes), offset);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xb = bcast4_avx512(xq + r * k + g * kGroup + u * 4);
        for (int c = 0; c < C; ++c) isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], wu[c], xb);
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m512 d = load_pair_ps(scale + 2 * c * tile_floats + g * kTile, tile_floats);
      for (int r = 0; r < R; ++r) {
        const __m512i sum = _mm512_set1_epi32(xsum[r * groups + g]);
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r][c], sum));
        acc[r][c] =
            _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(dx[r * groups + g])), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[r] + 16 * c, acc[r][c]);
  }
}

template <int R, int C>
AGENTX_AVX512 void run_pairs(bool int4, const uint8_t* w, int64_t tile_bytes, const float* scale,
                             const float* mins, int64_t tile_floats, const int8_t* xq,
                             const float* dx, const float* sx, const int32_t* xsum, int64_t k,
                             float* const* out, const Ahead* ahead) {
  if (int4) {
    pairs_int4<R, C>(w, tile_bytes, scale, mins, tile_floats, xq, dx, sx, k, out, ahead);
  } else {
    pairs_int8<R, C>(w, tile_bytes, scale, tile_floats, xq, xsum, dx, k, out, ahead);
  }
}

template <int C>
AGENTX_AVX512 void run_rows(int64_t rows, bool int4, const uint8_t* w, int64_t tile_bytes,
                            const float* scale, const float* mins, int64_t tile_floats,
                            const int8_t* xq, const float* dx, const float* sx,
                            const int32_t* xsum, int64_t k, float* const* out,
                            const Ahead* ahead) {
#define AGENTX_RUN_PAIRS(R) \
  run_pairs<R, C>(int4, w, tile_bytes, scale, mins, tile_floats, xq, dx, sx, xsum, k, out, ahead)
  switch (rows) {
    case 6: AGENTX_RUN_PAIRS(6); break;
    case 5: AGENTX_RUN_PAIRS(5); break;
    case 4: AGENTX_RUN_PAIRS(4); break;
    case 3: AGENTX_RUN_PAIRS(3); break;
    case 2: AGENTX_RUN_PAIRS(2); break;
    default: AGENTX_RUN_PAIRS(1); break;
  }
#undef AGENTX_RUN_PAIRS
}

}  // namespace

bool cpu_has_avx512_vnni() {
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
}

// Tiles [t0, t1) of y rows [r0, r0 + rows) (rows <= kRowsWide); out[r]: row r's first column
// of the tile t0 (16 (t1 - t0) / 2 floats). t1 - t0 is even. xsum (int8 only): 128 times the
// sum of each (row, group) of xq.
AGENTX_AVX512 void quantized_tiles_avx512(int64_t rows, int64_t t0, int64_t t1, bool int4,
                                          const uint8_t* w, int64_t tile_bytes,
                                          const float* scale, const float* mins,
                                          const int8_t* xq, const float* dx, const float* sx,
                                          const int32_t* xsum, int64_t k, float* const* out,
                                          int64_t fetch0, int64_t fetch1, bool to_l2) {
  const int64_t groups = k / kGroup, tile_floats = groups * kTile;
  float* o[qlinear::kRowsWide];
  // batch i of the nb batches (four tiles, an even last one fewer) fetches its part of
  // [fetch0, fetch1): tiles [fetch0 + n i / nb, fetch0 + n (i + 1) / nb), n = fetch1 - fetch0
  const int64_t nb = (t1 - t0 + 3) / 4, n = fetch1 - fetch0;
  const auto ahead_of = [&](int64_t t, Ahead* a) -> const Ahead* {
    const int64_t i = (t - t0) / 4, next = fetch0 + n * i / nb;
    const int64_t count = fetch0 + n * (i + 1) / nb - next;
    if (count <= 0) return nullptr;
    const char* base[3] = {reinterpret_cast<const char*>(w + next * tile_bytes),
                           reinterpret_cast<const char*>(scale + next * tile_floats),
                           mins ? reinterpret_cast<const char*>(mins + next * tile_floats)
                                : nullptr};
    const int64_t bytes[3] = {count * tile_bytes, count * tile_floats * 4,
                              mins ? count * tile_floats * 4 : 0};
    for (int s = 0; s < 3; ++s) {
      a->p[s] = base[s];
      a->bytes[s] = bytes[s];
      a->per_group[s] = ((bytes[s] + 63) / 64 + groups - 1) / groups;
    }
    a->to_l2 = to_l2;
    return a;
  };
  int64_t t = t0;
  for (; t + 4 <= t1; t += 4) {
    for (int64_t r = 0; r < rows; ++r) o[r] = out[r] + (t - t0) * kTile;
    Ahead a;
    run_rows<2>(rows, int4, w + t * tile_bytes, tile_bytes, scale + t * tile_floats,
                mins ? mins + t * tile_floats : nullptr, tile_floats, xq, dx, sx, xsum, k, o,
                ahead_of(t, &a));
  }
  for (; t < t1; t += 2) {
    for (int64_t r = 0; r < rows; ++r) o[r] = out[r] + (t - t0) * kTile;
    Ahead a;
    run_rows<1>(rows, int4, w + t * tile_bytes, tile_bytes, scale + t * tile_floats,
                mins ? mins + t * tile_floats : nullptr, tile_floats, xq, dx, sx, xsum, k, o,
                ahead_of(t, &a));
  }
}

}  // namespace agentx
