// The K-quant GEMM on AMX tiles (Intel Xeon from Sapphire Rapids on): the drive, the weight
// Tile and the float steps of the AVX-512 GEMM (qlinear_kquant_gemm_avx512.cpp,
// kquant_tile512.h), with each block's integer sums formed by tile dot products, 16 rows x 16
// columns x 64 features an instruction, instead of vpdpbusd.
//
// A tile product has no per-sub-block scale: it adds all 64 features of a row into one int32.
// So each column's scales are taken into its weights first, in pieces small enough for a byte:
//
//   Q4_K (sc in 0..63, q in 0..15, activations x int8; TDPBSUD: signed x unsigned bytes)
//     S1 = sum_k x_k sc_j(k) q_k = 16 (x . (sc >> 4) q) + (x . (sc & 15) q)
//     S2 = sum_k x_k m_j(k)                      (the min sum, a third piece)
//     pieces (sc >> 4) q <= 45, (sc & 15) q <= 225 and m <= 63: unsigned bytes
//   Q6_K (sc in -128..127, q' = q - 32 in -32..31; TDPBSSD: signed x signed bytes)
//     S = sum_k x_k sc_j(k) q'_k = sum_i 4^i (x . d_i q'),  sc = d0 + 4 d1 + 16 d2 + 64 d3
//     digits d0..d2 in 0..3 and d3 in -2..1 (sc's two top bits), so |d_i q'| <= 96
//
// Each piece's product over a 256-feature super-block is exact in int32 (|.| <= 256 * 225 *
// 128), and so is their sum: the integers are S1, S2 and S of the other K-quant paths (Q6_K's
// with its -32 offset already in), and the float steps are kquant_tile512.h's q4k_row and
// q6k_row: every output has the bits of the AVX-512 GEMM, the row groups and the reference.
//
//   for tile of 48 columns, rows m0 .. m0 + 256:      (kquant::for_each_tile)
//     for b in super-blocks:
//       unpack block b -> Tile
//       for group g of 16 columns:
//         its weights and scales -> P pieces x 4 chunks of 64 features (B tiles)
//         for rows r0, r0 + 16, ...:
//           C_i = sum over the chunks of A (16 rows of x, 64 bytes each) . piece i
//           the previous 16 rows' float steps into y (16 columns a vector), while the tile
//           unit forms these
//
// Tiles, all 16 rows x 64 bytes: C_i in tmm0-3, A in tmm4, pieces in tmm5-7. Measured on a
// Xeon (1 thread, Qwen2.5-Coder-1.5B's shapes), 1.05-1.35x the AVX-512 GEMM from 64 rows and
// slower below (kKquantGemmRowsAmx). Tried and slower there: 2 A tiles x 2 pieces a round
// (4 accumulators; the S2 sums then in vectors) with the next rows' x prefetched.
#include <ATen/ATen.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "kquant.h"
#include "kquant_tile512.h"
#include "parallel.h"

#define AGENTX_AMX                                                                       \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,amx-tile,amx-int8")))

namespace agentx {
namespace {

using kquant::kBlock;
using kquant::Rows;
using tile512::kGroups;
using tile512::kLanes;
using tile512::kRowChunk;
using tile512::kTileCols;
using tile512::Tile;

constexpr int kTileRows = 16;  // activation rows a tile product
constexpr int kChunks = 4;     // 64-feature chunks a super-block

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// piece i of chunk c: 16 rows (4-feature steps) x 16 columns x 4 bytes, a B tile
struct Pieces {
  alignas(64) int8_t b[4][kChunks][16 * 64];
};

// 16 rows' products: piece i, row r, column lane
using Products = int32_t[4][kTileRows][kLanes];

struct Work {  // a thread's
  Tile tile;
  Pieces pieces;
  alignas(64) Products c[2];  // one being formed, one being folded into y
  alignas(64) int8_t tail[kTileRows][kBlock];  // a short last tile's rows, zero padded
};

AGENTX_AMX void configure() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = kTileRows;
  }
  _tile_loadconfig(&cfg);
}

// Bytes (each <= 15) times their dword's scale (<= 15): the products (<= 225) stay in their
// bytes.
AGENTX_AMX inline __m512i mul_bytes(__m512i v, __m512i scale) {
  const __m512i even = _mm512_set1_epi32(0x00FF00FF);
  const __m512i sw = _mm512_or_si512(scale, _mm512_slli_epi32(scale, 16));  // both halves
  const __m512i lo = _mm512_mullo_epi16(_mm512_and_si512(v, even), sw);
  const __m512i hi = _mm512_mullo_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 8), even), sw);
  return _mm512_or_si512(lo, _mm512_slli_epi16(hi, 8));
}

// The dwords of v where bit `bit` of the lane's scale is set, others zero.
AGENTX_AMX inline __m512i where_bit(__m512i sc, int bit, __m512i v) {
  return _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(sc, _mm512_set1_epi32(1 << bit)), v);
}

// Group g of the Tile's block as pieces (header comment).
template <int64_t Type>
AGENTX_AMX void make_pieces(const Tile& t, int g, Pieces& p) {
  constexpr int kSub = Type == kQ4K ? 8 : 4;  // 4-weight steps a scale
  // shuffle control: each dword's low byte into all 4 of its bytes
  const __m512i own = _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0);
  __m512i mins = _mm512_setzero_si512();
  for (int s = 0; s < tile512::kSteps; ++s) {
    const int j = s / kSub, c = s / 16, row = s % 16;
    const __m512i q = _mm512_load_si512(t.q[g][s]);
    const __m512i sc = _mm512_load_si512(t.scale[g][j]);
    auto store = [&](int i, __m512i v) { _mm512_store_si512(p.b[i][c] + 64 * row, v); };
    if (Type == kQ4K) {
      if (s % kSub == 0) {  // sub-block j's min (pair j / 2, half j % 2) in each byte
        const __m512i pair = _mm512_load_si512(t.pairs[g][j / 2]);
        const __m512i m = _mm512_and_si512(_mm512_srli_epi32(pair, 16 * (j % 2)),
                                           _mm512_set1_epi32(0xFF));
        mins = _mm512_shuffle_epi8(m, own);
      }
      store(0, mul_bytes(q, _mm512_srli_epi32(sc, 4)));
      store(1, mul_bytes(q, _mm512_and_si512(sc, _mm512_set1_epi32(15))));
      store(2, mins);
    } else {
      const __m512i q1 = _mm512_sub_epi8(q, _mm512_set1_epi8(32));
      const __m512i q2 = _mm512_add_epi8(q1, q1);
      for (int i = 0; i < 3; ++i) {  // digit i of 0..3: bits 2 i (x1) and 2 i + 1 (x2)
        store(i, _mm512_add_epi8(where_bit(sc, 2 * i, q1), where_bit(sc, 2 * i + 1, q2)));
      }
      store(3, _mm512_sub_epi8(where_bit(sc, 6, q1), where_bit(sc, 7, q2)));  // -2 b7 + b6
    }
  }
}

// 16 rows (row r at x + r * ldx, block b's features) x the pieces: out[i] = A . piece i.
template <int64_t Type>
AGENTX_AMX void products(const Pieces& p, const int8_t* x, int64_t ldx, Products& out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  if (Type == kQ6K) _tile_zero(3);
  for (int c = 0; c < kChunks; ++c) {
    _tile_loadd(4, x + 64 * c, ldx);
    _tile_loadd(5, p.b[0][c], 64);
    _tile_loadd(6, p.b[1][c], 64);
    _tile_loadd(7, p.b[2][c], 64);
    if (Type == kQ4K) {
      _tile_dpbsud(0, 4, 5);
      _tile_dpbsud(1, 4, 6);
      _tile_dpbsud(2, 4, 7);
    } else {
      _tile_dpbssd(0, 4, 5);
      _tile_dpbssd(1, 4, 6);
      _tile_dpbssd(2, 4, 7);
      _tile_loadd(5, p.b[3][c], 64);
      _tile_dpbssd(3, 4, 5);
    }
  }
  _tile_stored(0, out[0], 64);
  _tile_stored(1, out[1], 64);
  _tile_stored(2, out[2], 64);
  if (Type == kQ6K) _tile_stored(3, out[3], 64);
}

// The float steps of rows [r0, r0 + rows) on group g from their products c.
template <int64_t Type>
AGENTX_AMX void fold(const Tile& t, int g, __mmask16 mask, const Products& c, const Rows& a,
                     int64_t r0, int rows, int64_t b, float* y, int64_t ldy) {
  const __m512 d = _mm512_load_ps(t.d + kLanes * g);
  const __m512 dmin = _mm512_load_ps(t.dmin + kLanes * g);
  for (int r = 0; r < rows; ++r) {
    const float dx = a.dx[(r0 + r) * a.blocks + b];
    float* yr = y + (r0 + r) * ldy + kLanes * g;
    const __m512i c0 = _mm512_load_si512(c[0][r]), c1 = _mm512_load_si512(c[1][r]);
    const __m512i c2 = _mm512_load_si512(c[2][r]);
    if (Type == kQ4K) {
      const __m512i s1 = _mm512_add_epi32(_mm512_slli_epi32(c0, 4), c1);
      tile512::q4k_row(d, dmin, s1, c2, dx, b == 0, yr, mask);
    } else {
      const __m512i c3 = _mm512_load_si512(c[3][r]);
      const __m512i high = _mm512_add_epi32(_mm512_slli_epi32(c3, 2), c2);   // d2 + 4 d3
      const __m512i mid = _mm512_add_epi32(_mm512_slli_epi32(high, 2), c1);  // d1 + 4 (...)
      tile512::q6k_row(d, _mm512_add_epi32(_mm512_slli_epi32(mid, 2), c0), dx, b == 0, yr, mask);
    }
  }
}

// Rows [m0, m1) x group g of the tile, block b: each 16 rows' products, and the previous 16
// rows' float steps while the tile unit forms them.
template <int64_t Type>
AGENTX_AMX void rows_group(Work& w, int g, int ncols, const Rows& a, int64_t m0, int64_t m1,
                           int64_t b, float* y, int64_t ldy) {
  const __mmask16 mask = tile512::group_mask(ncols, g);
  int64_t prev = -1;
  int prev_rows = 0, u = 0;
  for (int64_t r0 = m0; r0 < m1; r0 += kTileRows, ++u) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m1 - r0));
    const int8_t* x = a.xq + r0 * a.k + b * kBlock;
    int64_t ldx = a.k;
    if (rows < kTileRows) {  // not read past x
      std::memset(w.tail, 0, sizeof(w.tail));
      for (int r = 0; r < rows; ++r) std::memcpy(w.tail[r], x + r * a.k, kBlock);
      x = w.tail[0];
      ldx = kBlock;
    }
    products<Type>(w.pieces, x, ldx, w.c[u % 2]);
    if (prev >= 0) fold<Type>(w.tile, g, mask, w.c[(u + 1) % 2], a, prev, prev_rows, b, y, ldy);
    prev = r0;
    prev_rows = rows;
  }
  fold<Type>(w.tile, g, mask, w.c[(u + 1) % 2], a, prev, prev_rows, b, y, ldy);
}

// Rows [m0, m1) x the tile's columns [n0, n0 + ncols), block after block.
template <int64_t Type>
AGENTX_AMX void tile_rows(const uint8_t* wt, int64_t row_bytes, int64_t n0, int ncols,
                          const Rows& a, int64_t m0, int64_t m1, float* y, int64_t ldy, Work& w) {
  constexpr int64_t bytes = Type == kQ4K ? kquant::kQ4KBytes : kquant::kQ6KBytes;
  const int groups = static_cast<int>((ncols + kLanes - 1) / kLanes);
  for (int64_t b = 0; b < a.blocks; ++b) {
    if (b + 1 < a.blocks) kquant::prefetch_next_block(wt, row_bytes, n0, ncols, b, bytes);
    tile512::unpack<Type>(wt, row_bytes, n0, ncols, b, w.tile);
    for (int g = 0; g < groups; ++g) {
      make_pieces<Type>(w.tile, g, w.pieces);
      rows_group<Type>(w, g, ncols, a, m0, m1, b, y + n0, ldy);
    }
  }
}

// One pass of kquant::for_each_tile on this thread's tile registers, set up for it and
// released after it (a thread holding tile data makes every context switch save 8 KB more).
template <int64_t Type>
AGENTX_AMX void pass(const uint8_t* wt, int64_t row_bytes, int64_t n0, int ncols, const Rows& a,
                     int64_t m0, int64_t m1, float* y, int64_t ldy, Work& w) {
  configure();
  tile_rows<Type>(wt, row_bytes, n0, ncols, a, m0, m1, y, ldy, w);
  _tile_release();
}

}  // namespace

bool cpu_has_amx() {
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!cpu_has_avx512_vnni() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!((edx >> 24) & 1u) || !((edx >> 25) & 1u)) return false;  // AMX-TILE, AMX-INT8
    // Linux (5.16 on) hands out the 8 KB of tile data only to a process that asks
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has;
}

void kquant_gemm_amx(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n,
                     const int8_t* xq, const float* dx, const int16_t* sums, int64_t k, int64_t m,
                     float* y, int64_t ldy) {
  const Rows a{xq, dx, sums, k, k / kBlock};
  kquant::for_each_tile<Work>(n, m, kTileCols, kRowChunk, [&](Work& work, int64_t n0, int ncols,
                                                              int64_t m0, int64_t m1) {
    if (type == kQ4K) {
      pass<kQ4K>(w, row_bytes, n0, ncols, a, m0, m1, y, ldy, work);
    } else {
      pass<kQ6K>(w, row_bytes, n0, ncols, a, m0, m1, y, ldy, work);
    }
  });
}

}  // namespace agentx
