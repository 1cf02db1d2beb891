// Weight-only quantized linear layers with int8 activations, for AVX2 CPUs.
//
// y = x W^T with W stored group-wise (32 input features a group) as
//   int4: w = d * q + m, q in 0..15   (GGUF Q4_1, or quantized from floats on request)
//   int8: w = d * q,     q in -127..127 (GGUF Q8_0, or quantized from floats on request)
// and x quantized per row and per group to int8 (xq, scale dx, sum term sx = dx * sum(xq)):
//   y[r, n] = sum_g  d[n, g] * dx[r, g] * sum_k q[n, k] xq[r, k]   (+ m[n, g] * sx[r, g])
//
// Every output element is computed from its own row alone, in a fixed order, whatever the
// number of rows: results do not depend on batching or chunking.
//
// Packed layouts (8 output columns a tile, one column per 32-bit lane of a ymm register):
//   int4 qweight (N/8, K/8, 32) uint8: for tile t and k-octet o, byte j holds column c = j / 4,
//        low nibble  q[8t + c, 8o + j % 4], high nibble q[8t + c, 8o + 4 + j % 4]
//   int8 qweight (N/8, K/4, 32) int8:  for tile t and k-quad u, byte j = q[8t + j / 4, 4u + j % 4]
//   scale, min   (N/8, K/32, 8) float: for tile t and group g, lane c = column 8t + c
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "qlinear_common.h"
#include "scratch.h"

namespace agentx {
namespace {

using qlinear::bcast4;
using qlinear::kGroup;
using qlinear::kRows;
using qlinear::kTile;
// rows a pass over an int4 tile's weights on AVX2 (its int8 tiles take kRows)
constexpr int kRowsInt4 = 6;
using qlinear::kRowsWide;
// Weight bytes (tiles, scales, mins) a block of tile pairs that all AVX-512 row passes take
// before the next: on a 2-core Zen 4, 32-128 KB blocks made SmolLM2's int8 LM head from DRAM
// 1.5-2x faster at 8-64 rows than one block per thread (or 256-512 KB); int4 layers from
// cache ran the same
constexpr int64_t kBlockBytes = 128 * 1024;
// A share of one block (below) runs as sub-blocks of this many tile pairs, each sub-block's row
// passes one after another, so that a sub-block read from memory by the first pass serves the
// others from L1, and the reads of the next one spread over all of them. Passes over the whole
// share, the first fetching ahead alone, left the weights' read in the first pass: a decode
// step's GEMMs (8 rows: two passes) from memory ran about as long as their compute plus their
// read (qlinear_bench.py --rows 8 --layers 30, 2 threads, Zen 4, 6 alternated rounds: 5.3-6.7 ->
// 4.6-5.3 ms; 1 / 2 / 3 / 4 / 8 pairs: 5.0-5.2 / 4.6-5.3 / 4.8-4.9 / 4.7-5.8 / 4.9-5.5; the
// 8 x 2K decode step, one engine switching each step: -0.85 to -1.17 ms, 3-5%; 16 / 32 rows:
// 8.6-10.1 -> 7.5-9.8 / 14.7-24.4 -> 13.3-16.2 ms). Up to kSubBlockPasses passes: with more, the
// rows' activations (each sub-block reads all of them) outgrow L1 (64 rows: even, 512 rows: 7-10%
// slower than passes over the whole share). Blocks of a larger share likewise (the int8 LM
// head's, 8 x 2K decode steps switched step by step: -0.42 to -0.80 ms with blocks of 8-24 pairs
// fetched into L2, none fetched into L1).
constexpr int64_t kSubPairs = 2;
constexpr int64_t kSubBlockPasses = 6;
// A thread's share of weights up to share_in_l2() stays one block: it comes back from L2 for
// every pass anyway, and read as one long stream the first pass waits less on memory (in 128 KB
// blocks, gate_up from memory ran 0.54-0.65 -> 0.91 ms at 64 rows, 0.26-0.33 -> 0.37 at 16),
// fetching its next tiles ahead (blocked shares do not, below). Three quarters of a core's L2,
// within 512 KB and 1.5 MB (3/4 of the largest L2 here, 2 MB: a VM that reported its L3 as L2
// would otherwise read the int8 LM head from memory once a row pass again). SmolLM2's Q4_1
// gate_up is 0.66 MB a thread at 2 threads (its scales and mins a third of it), which a fixed
// 512 KB sent to blocks; one block on a Zen 4's 1 MB L2, 30 layers' GEMMs at 8 rows cycling
// through 80 MB of weights (qlinear_bench.py --layers 30, 2 threads, six alternated rounds in
// two runs): gate_up 2.77-3.20 -> 2.50-2.67 ms, all four 5.67-6.54 -> 5.48-5.93 ms.
int64_t share_in_l2() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    const int64_t share = l2 > 0 ? 3 * static_cast<int64_t>(l2) / 4 : 0;
    return std::clamp<int64_t>(share, 512 * 1024, 1536 * 1024);
  }();
  return bytes;
}

// Per row and group of 32: dx = amax / 127, xq = rint(x * 127 / amax), sx = dx * sum(xq).
// Vectorized, with the scalar definition's exact results: the max and the integer sum are
// exact in any order, and the rounding is the same round-half-to-even of the same products.
// A row's groups follow the previous row's (x and xq have k a row, dx and sx k / 32), so a
// range of rows is one run of groups, taken 8 at a time: their maxima side by side, one vector
// division each for their 8 scales and 8 inverses (the same IEEE quotients), then each group's
// products (one group at a time: 7.7 -> 4.9 ns a group on Zen 4, a standalone harness).
inline __m256 group_amax(const float* src) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(src));
  for (int j = 1; j < 4; ++j) {
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + 8 * j)));
  }
  return m;
}

// lane u: the largest of m[u]'s 8 lanes
inline __m256 hmax8x8(const __m256* m) {
  __m256 a[4];
  for (int i = 0; i < 4; ++i) {
    a[i] = _mm256_max_ps(_mm256_unpacklo_ps(m[2 * i], m[2 * i + 1]),
                         _mm256_unpackhi_ps(m[2 * i], m[2 * i + 1]));
  }
  const __m256 b0 =
      _mm256_max_ps(_mm256_shuffle_ps(a[0], a[1], 0x44), _mm256_shuffle_ps(a[0], a[1], 0xEE));
  const __m256 b1 =
      _mm256_max_ps(_mm256_shuffle_ps(a[2], a[3], 0x44), _mm256_shuffle_ps(a[2], a[3], 0xEE));
  return _mm256_max_ps(_mm256_permute2f128_ps(b0, b1, 0x20),
                       _mm256_permute2f128_ps(b0, b1, 0x31));
}

// n consecutive groups (x: 32 n floats; xq, dx, sx and, unless null, xsum (128 x each group's
// sum of xq: the AVX-512 int8 tiles') at those groups' places)
void quantize_run(const float* x, int64_t n, int8_t* xq, float* dx, float* sx, int32_t* xsum) {
  const __m256 steps = _mm256_set1_ps(127.f);
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t m = std::min<int64_t>(8, n - i);
    __m256 each[8];  // a last run of fewer than 8 repeats its last group
    for (int64_t u = 0; u < 8; ++u) each[u] = group_amax(x + (i + std::min(u, m - 1)) * kGroup);
    const __m256 top = hmax8x8(each);
    const __m256 d = _mm256_div_ps(top, steps);
    const __m256 inv = _mm256_and_ps(_mm256_div_ps(steps, top),
                                     _mm256_cmp_ps(top, _mm256_setzero_ps(), _CMP_GT_OQ));
    alignas(32) float ds[8], invs[8], totals[8];
    _mm256_store_ps(ds, d);
    _mm256_store_ps(invs, inv);
    for (int64_t u = 0; u < m; ++u) {
      const float* src = x + (i + u) * kGroup;
      const __m256 scale = _mm256_set1_ps(invs[u]);
      __m256i q[4];
      __m256i sum = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        // rint in the default rounding mode (to nearest even), as std::nearbyint
        q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + 8 * j), scale));
        sum = _mm256_add_epi32(sum, q[j]);
      }
      // int32 -> int8 (|q| <= 127): pack to 16 then 8 bits, undoing the lane interleave
      const __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
      const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + (i + u) * kGroup), p);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      const int32_t total = _mm_cvtsi128_si32(s4);
      totals[u] = static_cast<float>(total);
      if (xsum != nullptr) xsum[i + u] = 128 * total;
    }
    for (int64_t u = 0; u < m; ++u) {
      dx[i + u] = ds[u];
      sx[i + u] = ds[u] * totals[u];
    }
  }
}

void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* xq, float* dx, float* sx,
                   int32_t* xsum) {
  const int64_t groups = k / kGroup;
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    const int64_t first = begin * groups;
    quantize_run(x + first * kGroup, (end - begin) * groups, xq + first * kGroup, dx + first,
                 sx + first, xsum != nullptr ? xsum + first : nullptr);
  });
}

// An empty asm on the register: the adds stay one chain a row, as written. Without it GCC
// reassociates a group's 32 integer adds into a tree (the same sums) whose products outnumber
// AVX2's registers, and spills them to the stack.
inline void keep_chain(__m256i& v) { asm("" : "+x"(v)); }

// R rows x one tile of 8 columns, int4 weights.
template <int R>
void tile_int4(const uint8_t* w, const float* scale, const float* mins, const int8_t* xq,
               const float* dx, const float* sx, int64_t k, float* acc_out[R]) {
  const int64_t groups = k / kGroup;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int o = 0; o < 4; ++o) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      w += 32;
      const __m256i lo = _mm256_and_si256(packed, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * k + g * kGroup + o * 8;
        // 8 pairs of products a 16-bit lane, |each| <= 15 * 127: no saturation in a group
        isum[r] = _mm256_add_epi16(isum[r], _mm256_maddubs_epi16(lo, bcast4(xr)));
        isum[r] = _mm256_add_epi16(isum[r], _mm256_maddubs_epi16(hi, bcast4(xr + 4)));
        keep_chain(isum[r]);
      }
    }
    const __m256 d = _mm256_loadu_ps(scale + g * kTile);
    const __m256 m = _mm256_loadu_ps(mins + g * kTile);
    for (int r = 0; r < R; ++r) {
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum[r], ones));
      const int64_t rg = r * groups + g;
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(dx[rg])), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[rg]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc_out[r], acc[r]);
}

// R rows x one tile of 8 columns, int8 weights (signs moved onto x so maddubs sees |x|).
template <int R>
void tile_int8(const int8_t* w, const float* scale, const int8_t* xq, const float* dx,
               int64_t k, float* acc_out[R]) {
  const int64_t groups = k / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int u = 0; u < 8; ++u) {
      const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      w += 32;
      const __m256i wabs = _mm256_abs_epi8(wq);
      for (int r = 0; r < R; ++r) {
        const __m256i xb = bcast4(xq + r * k + g * kGroup + u * 4);
        // |w| * (x * sign(w)): |w| <= 127 (the packer clamps -128), pairs fit in 16 bits
        const __m256i prod = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xb, wq));
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(prod, ones));
        keep_chain(isum[r]);
      }
    }
    const __m256 d = _mm256_loadu_ps(scale + g * kTile);
    for (int r = 0; r < R; ++r) {
      const __m256 dot = _mm256_cvtepi32_ps(isum[r]);
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(dx[r * groups + g])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc_out[r], acc[r]);
}

template <int R>
void run_tile(bool int4, const uint8_t* w, const float* scale, const float* mins,
              const int8_t* xq, const float* dx, const float* sx, int64_t k, float* out[R]) {
  if (int4) {
    tile_int4<R>(w, scale, mins, xq, dx, sx, k, out);
  } else {
    tile_int8<R>(reinterpret_cast<const int8_t*>(w), scale, xq, dx, k, out);
  }
}

void check_weight(const at::Tensor& qweight, const at::Tensor& scale, const at::Tensor& mins,
                  int64_t k, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized_linear: bits must be 4 or 8");
  TORCH_CHECK(k % kGroup == 0 && scale.size(1) * kGroup == k, "in_features mismatch");
  TORCH_CHECK(qweight.is_contiguous() && scale.is_contiguous() &&
                  (bits == 8 || mins.is_contiguous()),
              "packed weights must be contiguous");
}

}  // namespace

int64_t kernel_isa(int64_t set) {
  static const int64_t best =
      cpu_has_amx() ? kIsaAmx : (cpu_has_avx512_vnni() ? kIsaAvx512 : kIsaAvx2);
  static std::atomic<int64_t> isa{best};
  if (set >= kIsaAvx2 && set <= best) isa = set;
  return isa;
}

void quantized_linear_into(const float* x, int64_t m, int64_t k, const at::Tensor& qweight,
                           const at::Tensor& scale, const at::Tensor& mins, int64_t bits,
                           float* y, int64_t ldy) {
  if (is_kquant(bits)) {  // GGUF super-blocks (qlinear_kquant.cpp); scale and mins unused
    kquant_linear_into(x, m, k, qweight, bits, y, ldy);
    return;
  }
  check_weight(qweight, scale, mins, k, bits);
  if (m == 0) return;
  const int64_t tiles = qweight.size(0), groups = k / kGroup;
  ScratchFrame scratch;
  int8_t* xq = scratch.take<int8_t>(m * k);
  float* dx = scratch.take<float>(m * groups);
  float* sx = scratch.take<float>(m * groups);
  const bool int4 = bits == 4;
  // AVX-512: pairs of tiles (an odd last tile below, with AVX2's tile: the same arithmetic)
  const bool wide = kernel_isa(-1) >= kIsaAvx512;
  // int8's: 128 * each group's sum of xq (qlinear_avx512.cpp)
  int32_t* xsum = wide && !int4 ? scratch.take<int32_t>(m * groups) : nullptr;
  quantize_rows(x, m, k, xq, dx, sx, xsum);
  const int64_t tile_bytes = qlinear::tile_bytes(int4, k);
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const float* sp = scale.data_ptr<float>();
  const float* mp = int4 ? mins.data_ptr<float>() : nullptr;
  const int8_t* xqp = xq;
  const float* dxp = dx;
  const float* sxp = sx;
  const int64_t pairs = wide ? tiles / 2 : 0;
  const int32_t* xsump = xsum;
  // AVX2's int4 tiles take 6 rows a pass over their weights (Zen 2, one 576 x 1536 layer's
  // tiles: 78.6 GMAC/s a thread against 71.4 with 4 rows; int8 tiles run as fast with 4)
  const int64_t single_rows = int4 ? kRowsInt4 : kRows;
  // AVX-512: a thread's share larger than share_in_l2() runs its row passes over blocks of
  // about kBlockBytes of weights, so that a block read once from memory serves every pass from
  // L2: the int8 LM head (28 MB at SmolLM2's shapes) was streamed from memory once a pass of up
  // to 6 rows (3 times at 16 rows).
  const int64_t tile_weight_bytes = tile_bytes + groups * kTile * (int4 ? 8 : 4);
  const int64_t block_pairs = std::max<int64_t>(1, kBlockBytes / (2 * tile_weight_bytes));
  parallel_for(0, pairs + (tiles - 2 * pairs), 1, [&](int64_t u0, int64_t u1) {
    // work units: pairs [0, pairs), then single tiles 2 * pairs + (u - pairs)
    const int64_t p1 = std::min(u1, pairs);
    const bool one_block = (p1 - u0) * 2 * tile_weight_bytes <= share_in_l2();
    // AVX-512: passes of up to kRowsWide rows, the rows split evenly among them (8 rows: two
    // passes of 4, not 6 and 2). Up to kSubBlockPasses passes, every pass runs over a block
    // before the next block, and the passes fetch the next block between them (pass i its i-th
    // part): a share of one block as sub-blocks of kSubPairs pairs (into L1), a larger share in
    // its blocks of about kBlockBytes (into L2: the int8 LM head, whose long runs fetched into L1
    // ran no faster, and fetched into L1 by the first pass alone slower: 1.55-1.67 -> 1.83-2.05
    // ms from memory at 8 rows, 3 alternated rounds, Zen 4). With more passes each pass runs over
    // the whole share (one block: the first fetching the tiles four on as it reads) or its block.
    const int64_t npass = (m + kRowsWide - 1) / kRowsWide;
    const bool spread = npass <= kSubBlockPasses;
    const int64_t step = one_block ? (spread ? kSubPairs : std::max<int64_t>(1, p1 - u0))
                                   : block_pairs;
    for (int64_t b0 = u0; b0 < p1; b0 += step) {
      const int64_t b1 = std::min(p1, b0 + step);
      const int64_t next1 = spread ? std::min(p1, b1 + step) : b1;  // pairs [b1, next1)
      int64_t pass = 0;
      for (int64_t r0 = 0, rows; r0 < m; r0 += rows, ++pass) {
        const int64_t passes = (m - r0 + kRowsWide - 1) / kRowsWide;
        rows = (m - r0 + passes - 1) / passes;
        float* out[kRowsWide];
        for (int64_t r = 0; r < rows; ++r) out[r] = y + (r0 + r) * ldy + 2 * b0 * kTile;
        int64_t fetch0 = 0, fetch1 = 0;  // tiles
        if (spread) {
          fetch0 = 2 * (b1 + (next1 - b1) * pass / npass);
          fetch1 = 2 * (b1 + (next1 - b1) * (pass + 1) / npass);
        } else if (one_block && pass == 0) {
          fetch0 = std::min(2 * b0 + 4, 2 * b1);
          fetch1 = 2 * b1;
        }
        quantized_tiles_avx512(rows, 2 * b0, 2 * b1, int4, wp, tile_bytes, sp, mp,
                               xqp + r0 * k, dxp + r0 * groups, sxp + r0 * groups,
                               xsump ? xsump + r0 * groups : nullptr, k, out, fetch0, fetch1,
                               !one_block);
      }
    }
    float buf[kRowsInt4][kTile];
    float* out[kRowsInt4];
    for (int r = 0; r < kRowsInt4; ++r) out[r] = buf[r];
    // AVX2 (every tile) and AVX-512's odd last tile: passes over the whole share. Blocks gained
    // nothing on AVX2 (Zen 4 capped to AVX2, the int8 LM head at 8-64 rows: its loop is bound by
    // its multiplies, not by the reads it repeats), nor did AVX-512's sub-blocks fetching ahead
    // (30 layers at 8 rows: 7.8-12.7 ms either way, a noisy hour)
    for (int64_t r0 = 0; r0 < m; r0 += single_rows) {
      const int64_t rows = std::min<int64_t>(single_rows, m - r0);
      for (int64_t u = std::max(u0, pairs); u < u1; ++u) {
        const int64_t t = 2 * pairs + (u - pairs);
        const uint8_t* w = wp + t * tile_bytes;
        const float* s = sp + t * groups * kTile;
        const float* mn = mp ? mp + t * groups * kTile : nullptr;
        const int8_t* xr = xqp + r0 * k;
        const float* dr = dxp + r0 * groups;
        const float* sr = sxp + r0 * groups;
        switch (rows) {
          case 6: tile_int4<6>(w, s, mn, xr, dr, sr, k, out); break;
          case 5: tile_int4<5>(w, s, mn, xr, dr, sr, k, out); break;
          case 4: run_tile<4>(int4, w, s, mn, xr, dr, sr, k, out); break;
          case 3: run_tile<3>(int4, w, s, mn, xr, dr, sr, k, out); break;
          case 2: run_tile<2>(int4, w, s, mn, xr, dr, sr, k, out); break;
          default: run_tile<1>(int4, w, s, mn, xr, dr, sr, k, out); break;
        }
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(y + (r0 + r) * ldy + t * kTile, buf[r], sizeof(float) * kTile);
        }
      }
    }
  });
}

namespace {

// x (M, K) float32 -> (M, N) float32.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& qweight,
                            const at::Tensor& scale, const at::Tensor& mins,
                            const c10::optional<at::Tensor>& bias, int64_t bits) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x must be (M, K) float32");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = qweight.size(0) * kTile;
  check_weight(qweight, scale, mins, k, bits);
  at::Tensor y = at::empty({m, n}, xc.options());
  quantized_linear_into(xc.data_ptr<float>(), m, k, qweight, scale, mins, bits,
                        y.data_ptr<float>(), n);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(agentx, lib) {
  lib.def(
      "quantized_linear(Tensor x, Tensor qweight, Tensor scale, Tensor mins, Tensor? bias, "
      "int bits) -> Tensor");
  lib.impl("quantized_linear", c10::DispatchKey::CPU, &quantized_linear);
  // -1: which instruction set the kernels use; 0 / 1: use AVX2 / AVX-512 VNNI (if present)
  lib.def("kernel_isa(int set) -> int", &kernel_isa);
  // this thread's scratch arena (scratch.h): [bytes held, blocks allocated so far]
  lib.def("scratch_stats() -> int[]", [] {
    const ScratchArena& arena = thread_scratch();
    return std::vector<int64_t>{arena.bytes(), arena.allocations()};
  });
}

}  // namespace agentx
