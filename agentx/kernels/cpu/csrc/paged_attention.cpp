// Paged attention over the KV cache, read in place through the block table, for decode and
// prefill rows alike.
//
// KV cache of one layer: (num_blocks, 2, block_size, num_kv_heads, head_dim), float32 or
// bfloat16; or int8 with each (token, KV head) row 4 bytes longer, its float32 scale after its
// head_dim codes (kernels/ref/kv_int8.py). An int8 row is read as codes in integer dot
// products (the query and each chunk's probabilities as int16 codes: "int8 caches", below), so
// dequantizing costs a multiply per key, not per element; bf16 reads its rows in paired order
// (below). Each query row is one token of one request and sees that request's first `len` keys
// (itself included: a decode row is the last, a prefill chunk's rows see one more key each);
// with a sliding window W only keys len - W .. len - 1 (blocks before that may already be freed
// and are never read). Query head h reads KV head h / (num_heads / num_kv_heads).
//
// Every row is computed by the same sequence of float operations whatever the other rows of
// the call: its keys are cut into splits of kSplitTokens from its first key, each split runs
// online softmax over chunks of kChunkTokens keys aligned from key 0 (a chunk spans several
// blocks when blocks are smaller), and the splits merge by their max and denominator.
// So a token attends identically when decoded, prefilled in a chunk, or recomputed after a
// prefix hit. Consecutive rows of one request (a prefill chunk) run as a tile that shares each
// K/V chunk while it is in L1; that changes which loads happen, not any row's arithmetic.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "scratch.h"

namespace agentx {
namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256i load_pairs8(const at::BFloat16* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline __m256 even8(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
inline __m256 odd8(__m256i x) {
  return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(-65536)));
}

// A value slice's 32 dims of key row v as 4 registers: in dim order, or for bf16 in paired order
// (the even dims of v[0..31], then the odd ones; kernels below)
template <typename T>
inline void load_values8(const T* v, __m256* out) {
  for (int j = 0; j < 4; ++j) out[j] = load8(v + 8 * j);
}
inline void load_values8(const at::BFloat16* v, __m256* out) {
  const __m256i x0 = load_pairs8(v), x1 = load_pairs8(v + 16);
  out[0] = even8(x0);
  out[1] = even8(x1);
  out[2] = odd8(x0);
  out[3] = odd8(x1);
}

// Half of that slice, its registers `half` and `half` + 2 for bf16 (x0's or x1's even and odd
// dims: one load), `2 half` and `2 half` + 1 otherwise. kHalfReg<T>(half, i): register i's index.
template <typename T>
constexpr int kHalfReg(int half, int i) {
  return std::is_same_v<T, at::BFloat16> ? half + 2 * i : 2 * half + i;
}
template <typename T>
inline void load_values8_half(const T* v, int half, __m256* out) {
  for (int i = 0; i < 2; ++i) out[i] = load8(v + 8 * kHalfReg<T>(half, i));
}
inline void load_values8_half(const at::BFloat16* v, int half, __m256* out) {
  const __m256i x = load_pairs8(v + 16 * half);
  out[0] = even8(x);
  out[1] = odd8(x);
}

// int8 caches: each (token, KV head) row ends in its float32 scale.
template <typename T>
constexpr bool kInt8 = std::is_same_v<T, int8_t>;
template <typename T>
constexpr int64_t kRowExtra = kInt8<T> ? 4 : 0;

// the scale of the int8 row whose codes start at `row` (D codes)
template <int D>
inline float row_scale(const int8_t* row) {
  float s;
  std::memcpy(&s, row + D, sizeof(s));
  return s;
}

// exp(x) for x <= 0: 2^n * e^r with n = round(x / ln 2), |r| <= ln(2) / 2, e^r by its Taylor
// series to r^7 (relative error < 1e-8 before float rounding); x below -87 gives ~0.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 split hi + lo
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// Softmax state of one (row, query head) inside a split; acc holds its D unnormalized sums.
struct State {
  float* acc;
  float max;
  float denom;
};

// Consecutive keys of one chunk that sit in one block: K rows at k, V rows at v.
template <typename T>
struct Segment {
  const T* k;
  const T* v;
  int64_t count;
};

// [sum(a[0]), ..., sum(a[3])], each lane ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)).
inline __m128 hsum4(const __m256* a) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// One key's score with the same arithmetic as a lane of row_scores: the FMA chain over the
// head, then hsum4's tree.
template <typename T, int D>
inline float dot1(const float* q, const T* k) {
  __m256 acc = _mm256_setzero_ps();
  for (int i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(load8(q + i), load8(k + i), acc);
  alignas(32) float a[8];
  _mm256_store_ps(a, acc);
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

inline float hmax(__m256 v) {
  const __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 n = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(n, _mm_shuffle_ps(n, n, 1)));
}

// ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// all-ones in the first n lanes (none for n <= 0, all for n >= 8)
inline __m256 tail_mask(int64_t n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes));
}

// Brings blocks into L2 ahead of their reads, a few cache lines at a time from inside the
// value loops and the bf16 score loops (AVX2's, and AVX-512's for rows that read K
// untransposed: decode rows): the hardware prefetcher does not follow the block table, and a
// burst of hundreds of prefetches at once stalls the core until memory answers them (the FMAs
// then wait instead of overlapping the transfer). The wider they are spread, the sooner the
// same lines arrive: on Zen 2, adding AVX2's score loop calls made decode from DRAM 6-7%
// faster, issuing them in tighter bursts (a cheaper step) 13-17% slower; on Zen 4, AVX-512's
// score loop calls (one a key) made 8 x 2K decode rows ~6% faster, one a 64-byte line of K, or a
// cheaper step that issues a call's lines back to back, slower. From L3 the calls cost ~20% of
// a decode row, but a step's KV comes from DRAM. `want`: lines to issue per call.
//
// Blocks from `split` on are the thread's next item's (`then`: its table, shifted so that
// block split + i is its first block + i): its first chunks arrive while this item's last
// ones are read, not at its start.
struct Prefetcher {
  const char* cache = nullptr;
  int64_t block_bytes = 0;  // one block's K and V, contiguous
  int64_t stride_bytes = 0;  // block to block in the pool
  const int64_t* table = nullptr;
  int64_t next = 0;  // the block being fetched
  int64_t offset = 0;  // bytes of it already asked for
  int64_t limit = 0;  // fetch blocks below this
  int64_t want = 0;
  int64_t split = INT64_MAX;
  const int64_t* then = nullptr;

  __attribute__((always_inline)) inline void step() {
    for (int64_t i = 0; i < want && next < limit; ++i) {
      const int64_t block = next < split ? table[next] : then[next - split];
      _mm_prefetch(cache + block * stride_bytes + offset, _MM_HINT_T1);
      offset += 64;
      if (offset >= block_bytes) {
        offset = 0;
        ++next;
      }
    }
  }
  inline void finish() {  // whatever the loops did not get to
    while (next < limit) {
      const int64_t w = want;
      want = block_bytes;
      step();
      want = w;
    }
  }
};

// A loop's Prefetcher in registers: the caller's copy is read once and written back at the end.
// Through the pointer, every step's position went through memory (a store and a reload a
// line); decode rows from L2 took 14% longer (Zen 4, 2 x 512 keys, 1 thread: 50-52 -> 43-44 us).
struct PrefetchScope {
  Prefetcher f;
  Prefetcher* home;
  explicit PrefetchScope(Prefetcher* p) : f(*p), home(p) {}
  ~PrefetchScope() { *home = f; }
  PrefetchScope(const PrefetchScope&) = delete;
  PrefetchScope& operator=(const PrefetchScope&) = delete;
};

constexpr int kMaxBlock = 256;
constexpr int kScoreStride = kMaxBlock + 8;

// Scores of keys [0, count) (kb, token_stride apart) for NH query heads of one row, four keys
// at a time so each K load serves every head; every score has dot1's arithmetic.
template <typename T, int D, int NH>
inline void row_scores(const float* q, const T* kb, int64_t count, int64_t ts, float scale,
                       float* score) {
  const __m128 scale4 = _mm_set1_ps(scale);
  int64_t t = 0;
  for (; t + 4 <= count; t += 4) {
    __m256 acc[NH][4];
    for (int h = 0; h < NH; ++h) {
      for (int j = 0; j < 4; ++j) acc[h][j] = _mm256_setzero_ps();
    }
    const T* k = kb + t * ts;
    for (int i = 0; i < D; i += 8) {
      const __m256 k0 = load8(k + i), k1 = load8(k + ts + i);
      const __m256 k2 = load8(k + 2 * ts + i), k3 = load8(k + 3 * ts + i);
      for (int h = 0; h < NH; ++h) {
        const __m256 qv = _mm256_loadu_ps(q + h * D + i);
        acc[h][0] = _mm256_fmadd_ps(qv, k0, acc[h][0]);
        acc[h][1] = _mm256_fmadd_ps(qv, k1, acc[h][1]);
        acc[h][2] = _mm256_fmadd_ps(qv, k2, acc[h][2]);
        acc[h][3] = _mm256_fmadd_ps(qv, k3, acc[h][3]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      _mm_storeu_ps(score + h * kScoreStride + t, _mm_mul_ps(hsum4(acc[h]), scale4));
    }
  }
  for (; t < count; ++t) {
    for (int h = 0; h < NH; ++h) {
      score[h * kScoreStride + t] = dot1<T, D>(q + h * D, kb + t * ts) * scale;
    }
  }
}

// acc[h] = acc[h] * correction[h] + sum_t p[h][t] v[t] for NH heads of one row (bf16: the sums
// in paired order), a slice of 32 dims at a time so each V load serves every head; per element
// the FMA chain runs t = 0, 1, ...
//
// Three heads' 12 accumulators, a bf16 slice's 4 registers and a broadcast need 17 of AVX2's 16
// registers (one accumulator would then live in memory, its chain waiting on a store each key),
// so three heads take a bf16 slice in two parts of R = 2 registers, the keys once for each.
// One bf16 row's three heads take row_values_bf16x3 instead (below), a tile's pairs of rows
// pair_values.
template <typename T, int D, int NH>
inline void row_values(const float* prob, const T* vb, int64_t count, int64_t ts,
                       const float* correction, State* const* st, Prefetcher* pf_home) {
  PrefetchScope pf_scope(pf_home);
  Prefetcher* pf = &pf_scope.f;
  constexpr int R = NH == 3 && std::is_same_v<T, at::BFloat16> ? 2 : 4;
  // part `part`'s register i: the slice's register reg(part, i)
  const auto reg = [](int part, int i) { return R == 4 ? i : kHalfReg<T>(part, i); };
  for (int s = 0; s < D; s += 32) {
    for (int part = 0; part < 4 / R; ++part) {
      __m256 acc[NH][R];
      for (int h = 0; h < NH; ++h) {
        const __m256 c = _mm256_set1_ps(correction[h]);
        for (int i = 0; i < R; ++i) {
          acc[h][i] = _mm256_mul_ps(_mm256_loadu_ps(st[h]->acc + s + 8 * reg(part, i)), c);
        }
      }
      for (int64_t t = 0; t < count; ++t) {
        if (part == 0) pf->step();  // once a key and slice, as its calls are counted
        __m256 vv[R];
        if constexpr (R == 4) {
          load_values8(vb + t * ts + s, vv);
        } else {
          load_values8_half(vb + t * ts + s, part, vv);
        }
        for (int h = 0; h < NH; ++h) {
          const __m256 p = _mm256_set1_ps(prob[h * kScoreStride + t]);
          for (int i = 0; i < R; ++i) acc[h][i] = _mm256_fmadd_ps(p, vv[i], acc[h][i]);
        }
      }
      for (int h = 0; h < NH; ++h) {
        for (int i = 0; i < R; ++i) _mm256_storeu_ps(st[h]->acc + s + 8 * reg(part, i), acc[h][i]);
      }
    }
  }
}

// row_values for three heads of one row over bf16 values, AVX2: a slice's four registers at
// once, so twelve accumulators run twelve independent FMA chains (row_values' two parts of six
// leave each FMA waiting on its own chain's previous one, a chain per key). The registers are
// exactly 16: twelve accumulators, the key's three probabilities and one value register, read
// again from memory for each of the four (the odd dims by two shifts: no mask register). The
// empty asm keeps GCC from merging those reads into one register that would not fit. Per
// element the FMA chain runs t = 0, 1, ...: row_values' bits.
template <int D>
inline void row_values_bf16x3(const float* prob, const at::BFloat16* vb, int64_t count,
                              int64_t ts, const float* correction, State* const* st,
                              Prefetcher* pf_home) {
  constexpr int NH = 3;
  PrefetchScope pf_scope(pf_home);
  Prefetcher* pf = &pf_scope.f;
  for (int s = 0; s < D; s += 32) {
    __m256 acc[NH][4];
    for (int h = 0; h < NH; ++h) {
      const __m256 c = _mm256_set1_ps(correction[h]);
      for (int i = 0; i < 4; ++i) {
        acc[h][i] = _mm256_mul_ps(_mm256_loadu_ps(st[h]->acc + s + 8 * i), c);
      }
    }
    for (int64_t t = 0; t < count; ++t) {
      pf->step();  // once a key and slice, as row_values' calls are counted
      const at::BFloat16* v = vb + t * ts + s;
      __m256 p[NH];
      for (int h = 0; h < NH; ++h) p[h] = _mm256_set1_ps(prob[h * kScoreStride + t]);
      // load_values8's registers: 0 and 1 the even dims of v[0..15] and v[16..31], 2 and 3
      // their odd dims
      for (int i = 0; i < 4; ++i) {
        const __m256i x = load_pairs8(v + 16 * (i & 1));
        const __m256 vv =
            i < 2 ? even8(x) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(x, 16), 16));
        for (int h = 0; h < NH; ++h) acc[h][i] = _mm256_fmadd_ps(p[h], vv, acc[h][i]);
        asm volatile("" ::: "memory");
      }
    }
    for (int h = 0; h < NH; ++h) {
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(st[h]->acc + s + 8 * i, acc[h][i]);
    }
  }
}

// The same two loops for AVX-512 CPUs, bit for bit: a zmm register holds two of the AVX2
// code's ymm accumulators (two keys' 8-dim slices, or 16 value dims), so every lane runs the
// AVX2 lane's FMA chain and the scores the same hsum4 tree, with half the instructions.
#define AGENTX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

AGENTX_AVX512 inline __m512 load2x8(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
AGENTX_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

AGENTX_AVX512 inline __m512 even16(__m512i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}
AGENTX_AVX512 inline __m512 odd16(__m512i x) {
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(-65536)));
}

// 64 dims of key row v as 4 registers: load_values8's order, 16 dims a register
template <typename T>
AGENTX_AVX512 inline void load_values16(const T* v, __m512* out) {
  for (int j = 0; j < 4; ++j) out[j] = load16(v + 16 * j);
}
AGENTX_AVX512 inline void load_values16(const at::BFloat16* v, __m512* out) {
  const __m512i x0 = _mm512_loadu_si512(v), x1 = _mm512_loadu_si512(v + 32);
  out[0] = even16(x0);
  out[1] = odd16(x0);
  out[2] = even16(x1);
  out[3] = odd16(x1);
}

// row_scores, eight keys at a time: register j holds keys j (low half) and j + 4 (high half)
template <typename T, int D, int NH>
AGENTX_AVX512 void row_scores_avx512(const float* q, const T* kb, int64_t count, int64_t ts,
                                     float scale, float* score) {
  const __m128 scale4 = _mm_set1_ps(scale);
  int64_t t = 0;
  for (; t + 8 <= count; t += 8) {
    __m512 acc[NH][4];
    for (int h = 0; h < NH; ++h) {
      for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_setzero_ps();
    }
    const T* k = kb + t * ts;
    for (int i = 0; i < D; i += 8) {
      __m512 kv[4];
      for (int j = 0; j < 4; ++j) kv[j] = load2x8(k + j * ts + i, k + (j + 4) * ts + i);
      for (int h = 0; h < NH; ++h) {
        const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + h * D + i));
        for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_fmadd_ps(qv, kv[j], acc[h][j]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      __m256 lo[4], hi[4];
      for (int j = 0; j < 4; ++j) {
        lo[j] = _mm512_castps512_ps256(acc[h][j]);
        hi[j] = _mm512_extractf32x8_ps(acc[h][j], 1);
      }
      float* sc = score + h * kScoreStride + t;
      _mm_storeu_ps(sc, _mm_mul_ps(hsum4(lo), scale4));
      _mm_storeu_ps(sc + 4, _mm_mul_ps(hsum4(hi), scale4));
    }
  }
  // the last < 8 keys: the AVX2 code, whose arithmetic per key is the same
  if (t < count) row_scores<T, D, NH>(q, kb + t * ts, count - t, ts, scale, score + t);
}

// row_values over a chunk's first `count` keys (its segments in order), 64 dims a pass (16 a
// register): the sums stay in registers from segment to segment (row_values, called per
// segment, takes a correction of 1 for the later ones: exact, so the same bits).
template <typename T, int D, int NH>
AGENTX_AVX512 void row_values_avx512(const float* prob, const Segment<T>* segs, int64_t count,
                                     int64_t ts, const float* correction, State* const* st,
                                     Prefetcher* pf_home) {
  PrefetchScope pf_scope(pf_home);
  Prefetcher* pf = &pf_scope.f;
  static_assert(D % 64 == 0, "head_dim must be a multiple of 64");
  for (int s = 0; s < D; s += 64) {
    __m512 acc[NH][4];
    for (int h = 0; h < NH; ++h) {
      const __m512 c = _mm512_set1_ps(correction[h]);
      for (int j = 0; j < 4; ++j) {
        acc[h][j] = _mm512_mul_ps(_mm512_loadu_ps(st[h]->acc + s + 16 * j), c);
      }
    }
    for (int64_t off = 0, g = 0; off < count; ++g) {
      const T* vb = segs[g].v;
      const int64_t n = std::min(segs[g].count, count - off);
      const float* pb = prob + off;
      for (int64_t t = 0; t < n; ++t) {
        pf->step();
        __m512 vv[4];
        load_values16(vb + t * ts + s, vv);
        for (int h = 0; h < NH; ++h) {
          const __m512 p = _mm512_set1_ps(pb[h * kScoreStride + t]);
          for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_fmadd_ps(p, vv[j], acc[h][j]);
        }
      }
      off += n;
    }
    for (int h = 0; h < NH; ++h) {
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(st[h]->acc + s + 16 * j, acc[h][j]);
    }
  }
}

// bf16 caches. A 64-byte line of a K or V row holds 32 bf16 values as 16 dwords, each two
// neighbouring dims: shifting a dword left by 16 gives the even dim as a float, masking off its
// low half the odd one (exact, two plain ALU ops per 16 values, no widening shuffles). Scores
// take bf16 products: the query is rounded to bf16 (to nearest even, denormals to zero) and a
// key's score is
//   16 lanes j, each one chain over the groups c of 32 dims: + q k of dim 32c + 2j + 1, then
//   + q k of dim 32c + 2j (exact products, each + rounded to float32, denormals flushed);
//   the lanes then fold in halves: j + (j + 8), then j + (j + 4), j + (j + 2), 0 + 1;
//   times the scale.
// A lane's two steps are what VDPBF16PS does for a dword (AVX512_BF16: one instruction a line
// and head), and what two FMAs do under MXCSR's DAZ and FTZ, which a bf16 tile sets on every
// CPU (AVX2, and AVX-512 without BF16, run the FMAs, 8 lanes a register): the same bits.
// The AVX2 loops read value rows in "paired order" (in each group of 32 dims: the 16 even ones,
// then the 16 odd ones; they keep the query in it too), the AVX-512 loop in "unpacked order"
// (bf16_values_avx512): value sums are kept in it and put back in dim order after the tile.
// Each dim of a value sum is one chain over the keys, each key's probability rounded to bf16
// (below, "bf16 value sums"): the other caches weigh by float32 probabilities.
constexpr int kPairGroup = 32;

// dims in paired order (d a multiple of 32)
inline void to_paired(const float* src, int64_t d, float* dst) {
  for (int64_t c = 0; c < d; c += kPairGroup) {
    for (int64_t j = 0; j < kPairGroup / 2; ++j) {
      dst[c + j] = src[c + 2 * j];
      dst[c + kPairGroup / 2 + j] = src[c + 2 * j + 1];
    }
  }
}

// paired order back to dim order, in place
inline void from_paired(float* x, int64_t d) {
  float group[kPairGroup];
  for (int64_t c = 0; c < d; c += kPairGroup) {
    std::memcpy(group, x + c, sizeof(group));
    for (int64_t j = 0; j < kPairGroup / 2; ++j) {
      x[c + 2 * j] = group[j];
      x[c + 2 * j + 1] = group[kPairGroup / 2 + j];
    }
  }
}

// x rounded to bf16 (to nearest, ties to even; denormals to signed zero), as a float
inline float bf16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7F800000u) == 0) {
    u &= 0x80000000u;
  } else if ((u & 0x7F800000u) != 0x7F800000u) {
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  } else if (u & 0x7FFFFFu) {
    u = (u | 0x400000u) & 0xFFFF0000u;  // NaN stays NaN
  }
  std::memcpy(&x, &u, sizeof(u));
  return x;
}

// bf16_round over n floats, 8 at a time where no lane is a NaN (the same integer steps)
void round_to_bf16(const float* src, int64_t n, float* dst) {
  const __m256i exponent = _mm256_set1_epi32(0x7F800000), one = _mm256_set1_epi32(1);
  const __m256i half = _mm256_set1_epi32(0x7FFF), high = _mm256_set1_epi32(-65536);
  const __m256i sign = _mm256_set1_epi32(INT32_MIN);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i e = _mm256_and_si256(u, exponent);
    if (!_mm256_testz_si256(_mm256_cmpeq_epi32(e, exponent), _mm256_set1_epi32(-1))) {
      for (int j = 0; j < 8; ++j) dst[i + j] = bf16_round(src[i + j]);  // an Inf or NaN
      continue;
    }
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, half), lsb), high);
    const __m256i tiny = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_blendv_epi8(r, _mm256_and_si256(u, sign), tiny));
  }
  for (; i < n; ++i) dst[i] = bf16_round(src[i]);
}

// Sets MXCSR's DAZ and FTZ for its lifetime, then puts MXCSR back.
struct FlushDenormals {
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

// one key's 16 lanes (lo: 0-7, hi: 8-15) fold to its sum in halves: b = lo + hi, then
// fold8(b): j + (j + 4), j + (j + 2), 0 + 1
inline float fold8(__m256 b) {
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

// four keys' lanes (b[k]: key k's lo + hi) folded as fold8 folds each: [s0, s1, s2, s3]
inline __m128 fold8x4(const __m256* b) {
  // j + (j + 4): [c0 | c1] and [c2 | c3]
  const __m256 c01 = _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20),
                                   _mm256_permute2f128_ps(b[0], b[1], 0x31));
  const __m256 c23 = _mm256_add_ps(_mm256_permute2f128_ps(b[2], b[3], 0x20),
                                   _mm256_permute2f128_ps(b[2], b[3], 0x31));
  // j + (j + 2): [d0_0 d0_1 d2_0 d2_1 | d1_0 d1_1 d3_0 d3_1]
  const __m256 d =
      _mm256_add_ps(_mm256_shuffle_ps(c01, c23, 0x44), _mm256_shuffle_ps(c01, c23, 0xEE));
  // 0 + 1: [s0 s2 s0 s2 | s1 s3 s1 s3]
  const __m256 e = _mm256_add_ps(_mm256_shuffle_ps(d, d, 0x88), _mm256_shuffle_ps(d, d, 0xDD));
  return _mm_unpacklo_ps(_mm256_castps256_ps128(e), _mm256_extractf128_ps(e, 1));
}

// One key's 16 lanes for NH heads (qp as below), lo + hi: b[h]
template <int D, int NH>
inline void bf16_key_lanes(const float* qp, const at::BFloat16* k, __m256* b) {
  __m256 lo[NH], hi[NH];
  for (int h = 0; h < NH; ++h) lo[h] = hi[h] = _mm256_setzero_ps();
  for (int c = 0; c < D; c += kPairGroup) {
    const __m256i x0 = load_pairs8(k + c), x1 = load_pairs8(k + c + 16);
    const __m256 e0 = even8(x0), o0 = odd8(x0), e1 = even8(x1), o1 = odd8(x1);
    for (int h = 0; h < NH; ++h) {
      const float* qh = qp + h * D + c;
      lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 16), o0, lo[h]);
      lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh), e0, lo[h]);
      hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 24), o1, hi[h]);
      hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8), e1, hi[h]);
    }
  }
  for (int h = 0; h < NH; ++h) b[h] = _mm256_add_ps(lo[h], hi[h]);
}

// Scores of keys [0, count) for NH query heads (qp: each head's D rounded dims in paired
// order), one key at a time (2 NH accumulators and the key's four registers fit AVX2's 16),
// four keys' lanes folded together.
template <int D, int NH>
inline void bf16_scores(const float* qp, const at::BFloat16* kb, int64_t count, int64_t ts,
                        float scale, float* score, Prefetcher* pf_home) {
  PrefetchScope pf_scope(pf_home);
  Prefetcher* pf = &pf_scope.f;
  const __m128 scale4 = _mm_set1_ps(scale);
  int64_t t = 0;
  for (; t + 4 <= count; t += 4) {
    __m256 key[4][NH];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      pf->step();
      bf16_key_lanes<D, NH>(qp, kb + (t + j) * ts, key[j]);
    }
    for (int h = 0; h < NH; ++h) {
      const __m256 b[4] = {key[0][h], key[1][h], key[2][h], key[3][h]};
      _mm_storeu_ps(score + h * kScoreStride + t, _mm_mul_ps(fold8x4(b), scale4));
    }
  }
  for (; t < count; ++t) {
    __m256 b[NH];
    pf->step();
    bf16_key_lanes<D, NH>(qp, kb + t * ts, b);
    for (int h = 0; h < NH; ++h) score[h * kScoreStride + t] = fold8(b[h]) * scale;
  }
}

// four keys' 16 lanes folded as fold8 folds each key's lo + hi: [s0, s1, s2, s3]
AGENTX_AVX512 inline __m128 fold16x4(const __m512* a) {
  const __m512 b01 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x44),
                                   _mm512_shuffle_f32x4(a[0], a[1], 0xEE));  // j + (j + 8)
  const __m512 b23 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x44),
                                   _mm512_shuffle_f32x4(a[2], a[3], 0xEE));
  const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(b01, b23, 0x88),
                                 _mm512_shuffle_f32x4(b01, b23, 0xDD));  // j + (j + 4)
  const __m512 d = _mm512_add_ps(c, _mm512_permute_ps(c, 0x4E));  // j + (j + 2)
  const __m512 e = _mm512_add_ps(d, _mm512_permute_ps(d, 0xB1));  // 0 + 1
  const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(first, e));
}

// AVX-512 CPUs with AVX512_BF16: one VDPBF16PS a 64-byte line and head
#define AGENTX_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

bool cpu_has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

// Whether bf16 caches take the AVX-512 loops (VDPBF16PS) at the kernels' current ISA; the AVX2
// loops, elsewhere, give the same bits with two FMAs a pair
bool bf16_wide_loops() { return kernel_isa(-1) >= kIsaAvx512 && cpu_has_avx512_bf16(); }

// d floats already rounded to bf16 (a multiple of 32) as bf16: exact
AGENTX_AVX512BF16 void to_bf16(const float* src, int64_t d, at::BFloat16* dst) {
  for (int64_t c = 0; c < d; c += 32) {
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + c + 16), _mm512_loadu_ps(src + c));
    _mm512_storeu_si512(dst + c, (__m512i)b);
  }
}

// n <= KB keys from k (ts apart) for NH heads (qb: each head's D rounded dims as bf16, in dim
// order, D floats apart): their scores at score[h * kScoreStride + j]. The key loop is unrolled
// by pragma: GCC does not unroll a loop that holds the Prefetcher's step (a loop itself), and
// acc[h][j] indexed by a loop variable lived on the stack, a store and a reload a VDPBF16PS
// (bf16_value_keys' sums too, stored and reloaded every pair of keys). Decode rows of 8 x 2K
// keys from L3, one Zen 4 thread: 800-830 -> 608-610 us a layer; AVX2 (bf16_scores' key loop,
// the same): 994-1060 -> 877-916 us.
template <int D, int NH, int KB>
AGENTX_AVX512BF16 __attribute__((always_inline)) inline void bf16_key_block(
    const float* qb, const at::BFloat16* k, int n, int64_t ts, __m128 scale4, float* score,
    Prefetcher* pf) {
  __m512 acc[NH][KB];
  for (int h = 0; h < NH; ++h) {
    for (int j = 0; j < KB; ++j) acc[h][j] = _mm512_setzero_ps();
  }
#pragma GCC unroll 8
  for (int j = 0; j < KB && j < n; ++j) {
    pf->step();
#pragma GCC unroll 8
    for (int c = 0; c < D; c += kPairGroup) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(k + j * ts + c);
      for (int h = 0; h < NH; ++h) {
        const at::BFloat16* qh = reinterpret_cast<const at::BFloat16*>(qb + h * D) + c;
        acc[h][j] = _mm512_dpbf16_ps(acc[h][j], x, (__m512bh)_mm512_loadu_si512(qh));
      }
    }
  }
  for (int h = 0; h < NH; ++h) {
    for (int j = 0; j < KB && j < n; j += 4) {
      const __m128 s = _mm_mul_ps(fold16x4(acc[h] + j), scale4);
      float* dst = score + h * kScoreStride + j;
      if (n - j >= 4) {
        _mm_storeu_ps(dst, s);
      } else {
        _mm_mask_storeu_ps(dst, static_cast<__mmask8>((1 << (n - j)) - 1), s);
      }
    }
  }
}

// bf16_scores, a block of keys at a time (8, or 4 for more than 3 heads: NH x KB accumulators)
// so that four keys' lanes fold together; a Prefetcher step a key
template <int D, int NH>
AGENTX_AVX512BF16 void bf16_scores_avx512(const float* qb, const at::BFloat16* kb,
                                          int64_t count, int64_t ts, float scale, float* score,
                                          Prefetcher* pf_home) {
  PrefetchScope pf_scope(pf_home);
  Prefetcher* pf = &pf_scope.f;
  constexpr int KB = NH > 3 ? 4 : 8;
  const __m128 scale4 = _mm_set1_ps(scale);
  int64_t t = 0;
  for (; t + KB <= count; t += KB) {
    bf16_key_block<D, NH, KB>(qb, kb + t * ts, KB, ts, scale4, score + t, pf);
  }
  if (t < count) {
    bf16_key_block<D, NH, KB>(qb, kb + t * ts, static_cast<int>(count - t), ts, scale4,
                              score + t, pf);
  }
}

// exp_nonpositive on 16 lanes: lane for lane the same operations
AGENTX_AVX512 inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// The softmax's exps of the whole 16s of count keys for NH heads (head h's scores at
// sc + h kScoreStride, less max[h]), in place, added into the eight lanes of sum[h] in key order
// (keys t .. t + 7, then t + 8 .. t + 15): what the eight-lane loop does for them. Returns
// where they end.
template <int NH>
AGENTX_AVX512 inline int64_t exp_sum16(float* sc, int64_t count, const float* max, __m256* sum) {
  int64_t t = 0;
  for (; t + 16 <= count; t += 16) {
    for (int h = 0; h < NH; ++h) {
      float* x = sc + h * kScoreStride + t;
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(x), _mm512_set1_ps(max[h])));
      _mm512_storeu_ps(x, e);
      sum[h] = _mm256_add_ps(sum[h], _mm512_castps512_ps256(e));
      sum[h] = _mm256_add_ps(sum[h], _mm512_extractf32x8_ps(e, 1));
    }
  }
  return t;
}

// A tile's rows share each chunk's keys, so for them the chunk's K rows of one KV head are
// transposed once (kt[p * kKtKeys + t]: key t's dword p, dims 2p and 2p + 1) and a score
// register holds 16 keys: lane j's chain of bf16_key_block becomes a register s_j (VDPBF16PS
// with key dword 16c + j and the query's, c = 0, 1, ...), and its fold becomes adds of whole
// registers in the same tree: (s_j + s_j+8), then + the one 4 further, 2 further, 1 further.
// Every score is bf16_key_block's, bit for bit; the 16-lane fold's shuffles are gone.
constexpr int64_t kKtKeys = 64;  // keys a transposed chunk (chunks of blocks <= 64 tokens)

// r[i] = row i's 16 dwords -> r[p] = dword p of rows 0 .. 15
AGENTX_AVX512 inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i u[16];  // u[4 g + k], 128-bit lane L: dword 4 L + k of rows 4 g .. 4 g + 3
  for (int g = 0; g < 4; ++g) {
    const __m512i* x = t + 4 * g;
    u[4 * g] = _mm512_unpacklo_epi64(x[0], x[2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(x[0], x[2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(x[1], x[3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(x[1], x[3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44);
    const __m512i x1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
    const __m512i x3 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
}

// The first `count` (<= kKtKeys) keys of a chunk (its segments in order) for one KV head into
// kt; keys count .. the next multiple of 16 are zeros.
template <int D>
AGENTX_AVX512 void transpose_keys(const Segment<at::BFloat16>* segs, int64_t count, int64_t ts,
                                  uint32_t* kt) {
  const at::BFloat16* rows[kKtKeys];
  for (int64_t off = 0, s = 0; off < count; ++s) {
    const int64_t n = std::min(segs[s].count, count - off);
    for (int64_t t = 0; t < n; ++t) rows[off + t] = segs[s].k + t * ts;
    off += n;
  }
  for (int64_t t0 = 0; t0 < count; t0 += 16) {
    for (int c = 0; c < D / 32; ++c) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = t0 + i < count ? _mm512_loadu_si512(rows[t0 + i] + 32 * c) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(kt + (16 * c + p) * kKtKeys + t0, r[p]);
    }
  }
}

template <int N>
struct Keys16 {
  __m512 v[N];  // 16 keys' scores (or partial sums) for each of N heads
};

// acc + VDPBF16PS(x, the bf16 pair at p + OFF dwords in every lane): the pair comes as the
// instruction's embedded broadcast, a load alone, its address p's register and a constant.
// Written with the intrinsics (or with p + OFF as a memory operand) GCC hoisted the pairs that
// stay the same over a loop (a query's dwords over the keys) and kept them on the stack: a
// 64-byte reload (or an address reload) a VDPBF16PS. The operands' order does not change a
// product (each is exact, then the adds in the instruction's order), so the same bits.
template <int OFF>
AGENTX_AVX512BF16 __attribute__((always_inline)) inline __m512 dpbf16_bcast(__m512 acc,
                                                                            __m512bh x,
                                                                            const uint32_t* p) {
  asm("vdpbf16ps %c[off](%[p])%{1to16%}, %[x], %[acc]"
      : [acc] "+v"(acc)
      : [x] "v"(x), [p] "r"(p), [off] "i"(4 * OFF),
        "m"(*reinterpret_cast<const uint32_t(*)[OFF + 1]>(p)));  // it reads p[0 .. OFF]
  return acc;
}

// dpbf16_bcast with the pair at p[OFF + i] (i a run-time index, N: the dwords p's array holds)
template <int OFF, int N>
AGENTX_AVX512BF16 __attribute__((always_inline)) inline __m512 dpbf16_bcast_at(
    __m512 acc, __m512bh x, const uint32_t* p, int64_t i) {
  asm("vdpbf16ps %c[off](%[p],%[i],4)%{1to16%}, %[x], %[acc]"
      : [acc] "+v"(acc)
      : [x] "v"(x), [p] "r"(p), [i] "r"(i), [off] "i"(4 * OFF),
        "m"(*reinterpret_cast<const uint32_t(*)[N]>(p)));
  return acc;
}

// lane J's chains for NH heads: step c of the chain (dwords 16 c + J) for head h is
// I = c NH + h, so that each K load serves the NH heads in a row
template <int D, int NH, int J, int... I>
AGENTX_AVX512BF16 __attribute__((always_inline)) inline void leaf_chain(
    const uint32_t* qd, const uint32_t* kt, Keys16<NH>& out, std::integer_sequence<int, I...>) {
  __m512bh k;
  ((I % NH == 0 ? (void)(k = (__m512bh)_mm512_loadu_si512(kt + (16 * (I / NH) + J) * kKtKeys))
                : (void)0,
    out.v[I % NH] = dpbf16_bcast<(I % NH) * D + 16 * (I / NH) + J>(out.v[I % NH], k, qd)),
   ...);
}

// NH heads' registers of 16 keys (from key vector 0 of kt; head h's query dwords at qd + h D):
// lane chain J, or the tree over the lanes J, J + STEP, ... that bf16_key_block's fold adds in
// the subtree of J at step STEP. Each load of 16 keys' dword serves every head (one head a pass
// loaded it NH times); each head's register takes the same operations as one head alone.
template <int D, int NH, int J, int STEP>
AGENTX_AVX512BF16 __attribute__((always_inline)) inline Keys16<NH> fold_tree_heads(
    const uint32_t* qd, const uint32_t* kt) {
  Keys16<NH> out;
  if constexpr (STEP == 16) {  // a lane's chain, for each head
    for (int h = 0; h < NH; ++h) out.v[h] = _mm512_setzero_ps();
    leaf_chain<D, NH, J>(qd, kt, out, std::make_integer_sequence<int, D / 32 * NH>{});
  } else {
    const Keys16<NH> a = fold_tree_heads<D, NH, J, 2 * STEP>(qd, kt);
    const Keys16<NH> b = fold_tree_heads<D, NH, J + STEP, 2 * STEP>(qd, kt);
    for (int h = 0; h < NH; ++h) out.v[h] = _mm512_add_ps(a.v[h], b.v[h]);
  }
  return out;
}

// bf16_scores_avx512's scores of keys [0, count) from a transposed chunk: for NH heads of one
// row (qb: each head's D rounded dims as bf16), 16 keys at a time, every head on each load
// (up to 3 heads a pass: their trees' registers fit). With the value sums' pairs as embedded
// broadcasts too (pair_sums), a 2K prompt's last 512 rows from cache, one Zen 4 thread, six
// alternated rounds (attention_kernel_bench.py --rows 512 --layers 1): 19.2-21.4 -> 18.1-19.3 ms
template <int D, int NH>
AGENTX_AVX512BF16 void bf16_scores_kt(const float* qb, const uint32_t* kt, int64_t count,
                                      float scale, float* score) {
  const __m512 sc = _mm512_set1_ps(scale);
  constexpr int P = NH < 3 ? NH : 3;  // heads a pass
  for (int h0 = 0; h0 < NH; h0 += P) {
    if (h0 + P > NH) {  // NH not a multiple of 3: the last heads one at a time
      for (int h = h0; h < NH; ++h) bf16_scores_kt<D, 1>(qb + h * D, kt, count, scale,
                                                         score + h * kScoreStride);
      break;
    }
    const uint32_t* qd = reinterpret_cast<const uint32_t*>(qb + h0 * D);
    for (int64_t t = 0; t < count; t += 16) {
      const Keys16<P> s = fold_tree_heads<D, P, 0, 1>(qd, kt + t);
      for (int h = 0; h < P; ++h) {
        _mm512_storeu_ps(score + (h0 + h) * kScoreStride + t, _mm512_mul_ps(s.v[h], sc));
      }
    }
  }
}

// bf16 value sums (every CPU): a key's probability is rounded to bf16 (to nearest even) before
// it weighs the key's value row, so each product is exact and each step of a dim's chain over
// the keys one rounded add (the softmax denominators still sum the unrounded exps; FlashAttention
// rounds its probabilities the same way before P V). Keys go in pairs from a chunk's first:
// VDPBF16PS adds key t's product, then key t + 1's, to a float lane; a chunk's odd last key
// pairs with a zero probability and a zero row, so its chain ends in "+ 0" (which only turns a
// -0 sum into +0). The AVX2 loops take the same steps by FMAs, denormals flushed as VDPBF16PS
// flushes them, and add that zero too.
//
// The AVX-512 loop interleaves the value rows of keys t + 1 and t by word (unpacklo / unpackhi
// within 128-bit lanes), so a slice's 64 dims sit in "unpacked order": register j, lane
// 4 L + w holds dim 32 (j / 2) + 8 L + 4 (j % 2) + w. from_unpacked puts them back.
constexpr int kPairsStride = kMaxBlock / 2 + 16;

// unpacked order back to dim order, in place (d a multiple of 64)
inline void from_unpacked(float* x, int64_t d) {
  for (int64_t c = 0; c < d; c += 64) {
    __m128 slice[16];  // lane L of register j: 4 dims from 32 (j / 2) + 8 L + 4 (j % 2)
    for (int s = 0; s < 16; ++s) slice[s] = _mm_loadu_ps(x + c + 4 * s);
    for (int s = 0; s < 16; ++s) {
      const int j = s / 4, lane = s % 4;
      _mm_storeu_ps(x + c + 32 * (j / 2) + 8 * lane + 4 * (j % 2), slice[s]);
    }
  }
}

// n <= kMaxBlock probabilities as bf16 pairs: dword i holds p[2i + 1] (low word) and p[2i]
// (high word), VDPBF16PS's order for "key 2i, then key 2i + 1"; p[n] reads as zero.
AGENTX_AVX512BF16 inline void bf16_prob_pairs(const float* p, int64_t n, uint32_t* out) {
  for (int64_t i = 0; i < n; i += 32) {
    const int64_t left = n - i;
    const __mmask16 lo = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __mmask16 hi =
        left >= 32 ? 0xFFFF : left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1);
    const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, p + i + 16),
                                           _mm512_maskz_loadu_ps(lo, p + i));
    _mm512_storeu_si512(out + i / 2, _mm512_rol_epi32((__m512i)w, 16));
  }
}

// A chunk's first `count` keys (its segments in order): each key's value row
inline void value_rows(const Segment<at::BFloat16>* segs, int64_t count, int64_t ts,
                       const at::BFloat16** rows) {
  for (int64_t off = 0, g = 0; off < count; ++g) {
    const int64_t n = std::min(segs[g].count, count - off);
    for (int64_t t = 0; t < n; ++t) rows[off + t] = segs[g].v + t * ts;
    off += n;
  }
}

// acc[h] = acc[h] * correction[h] + sum_t bf16(p[h][t]) v[t] for NH heads of one row over keys
// [from, count) (from even; pairs: each head's probabilities as bf16_prob_pairs packs them,
// rows: each key's value row), in unpacked order, 64 dims a pass: per pair of keys two unpacks
// a 64-byte line and one VDPBF16PS a head and 16 dims. The head and slice loops are unrolled
// by pragma, as bf16_key_block's key loop (there, why).
template <int D, int NH>
AGENTX_AVX512BF16 __attribute__((always_inline)) inline void bf16_value_keys(
    const uint32_t (*pairs)[kPairsStride], const at::BFloat16* const* rows, int64_t from,
    int64_t count, const float* correction, State* const* st, Prefetcher* pf) {
  static_assert(D % 64 == 0, "head_dim must be a multiple of 64");
  for (int s = 0; s < D; s += 64) {
    __m512 acc[NH][4];
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const __m512 c = _mm512_set1_ps(correction[h]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        acc[h][j] = _mm512_mul_ps(_mm512_loadu_ps(st[h]->acc + s + 16 * j), c);
      }
    }
    for (int64_t t = from; t < count; t += 2) {
      pf->step();
      const __m512i a0 = _mm512_loadu_si512(rows[t] + s), a1 = _mm512_loadu_si512(rows[t] + s + 32);
      __m512i b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
      if (t + 1 < count) {  // else key t pairs with a zero row (and a zero probability)
        pf->step();
        b0 = _mm512_loadu_si512(rows[t + 1] + s);
        b1 = _mm512_loadu_si512(rows[t + 1] + s + 32);
      }
      const __m512bh x[4] = {(__m512bh)_mm512_unpacklo_epi16(b0, a0),
                             (__m512bh)_mm512_unpackhi_epi16(b0, a0),
                             (__m512bh)_mm512_unpacklo_epi16(b1, a1),
                             (__m512bh)_mm512_unpackhi_epi16(b1, a1)};
#pragma GCC unroll 8
      for (int h = 0; h < NH; ++h) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[h][t / 2]));
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_dpbf16_ps(acc[h][j], x[j], p);
      }
    }
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(st[h]->acc + s + 16 * j, acc[h][j]);
    }
  }
}

// acc[h] = acc[h] * correction[h] + sum_t bf16(p[h][t]) v[t] for NH heads of one row over a
// chunk's first `count` keys (its segments in order): bf16_value_keys over them all.
template <int D, int NH>
AGENTX_AVX512BF16 void bf16_values_avx512(const float* prob, const Segment<at::BFloat16>* segs,
                                          int64_t count, int64_t ts, const float* correction,
                                          State* const* st, Prefetcher* pf_home) {
  PrefetchScope pf_scope(pf_home);
  alignas(64) uint32_t pairs[NH][kPairsStride];
  for (int h = 0; h < NH; ++h) bf16_prob_pairs(prob + h * kScoreStride, count, pairs[h]);
  const at::BFloat16* rows[kMaxBlock];
  value_rows(segs, count, ts, rows);
  bf16_value_keys<D, NH>(pairs, rows, 0, count, correction, st, &pf_scope.f);
}

// One pair of keys into the sums of NH heads of two rows (bf16_values_pair): sum I is row
// I / (4 NH), head I / 4 % NH, register I % 4; its probabilities' pair is dword i of row r's
// head h (pairs[r][h], kPairsStride apart), an embedded broadcast (dpbf16_bcast)
template <int NH, int... I>
AGENTX_AVX512BF16 __attribute__((always_inline)) inline void pair_sums(
    __m512 (&acc)[2][NH][4], const __m512bh* x, const uint32_t* pairs, int64_t i,
    std::integer_sequence<int, I...>) {
  ((acc[I / (4 * NH)][I / 4 % NH][I % 4] = dpbf16_bcast_at<(I / 4) * kPairsStride,
                                                           2 * NH * kPairsStride>(
        acc[I / (4 * NH)][I / 4 % NH][I % 4], x[I % 4], pairs, i)),
   ...);
}

// bf16_values_avx512 for three heads of two rows of a tile at once (counts[r] keys each): the
// pairs of keys both rows have in full share each value row's loads and unpacks (24
// accumulators), then each row's last keys alone, continuing each sum (a correction of 1:
// exact). Every row's arithmetic is bf16_values_avx512's. A 2K prompt's 512-row tile, one
// thread: 19.3-19.6 -> 18.3-18.5 ms (Zen 4, 3 alternated rounds).
template <int D>
AGENTX_AVX512BF16 void bf16_values_pair(const float* const* prob,
                                        const Segment<at::BFloat16>* segs, const int64_t* counts,
                                        int64_t ts, const float* const* correction,
                                        State* const* const* st, Prefetcher* pf_home) {
  constexpr int NH = 3;
  PrefetchScope pf_scope(pf_home);
  Prefetcher* pf = &pf_scope.f;
  alignas(64) uint32_t pairs[2][NH][kPairsStride];
  for (int r = 0; r < 2; ++r) {
    for (int h = 0; h < NH; ++h) {
      bf16_prob_pairs(prob[r] + h * kScoreStride, counts[r], pairs[r][h]);
    }
  }
  const at::BFloat16* rows[kMaxBlock];
  value_rows(segs, std::max(counts[0], counts[1]), ts, rows);
  const int64_t both = std::min(counts[0], counts[1]) & ~int64_t{1};
  for (int s = 0; s < D; s += 64) {
    __m512 acc[2][NH][4];
    for (int r = 0; r < 2; ++r) {
      for (int h = 0; h < NH; ++h) {
        const __m512 c = _mm512_set1_ps(correction[r][h]);
        for (int j = 0; j < 4; ++j) {
          acc[r][h][j] = _mm512_mul_ps(_mm512_loadu_ps(st[r][h]->acc + s + 16 * j), c);
        }
      }
    }
    for (int64_t t = 0; t < both; t += 2) {
      pf->step();  // two a pair of keys, as bf16_value_keys calls them
      pf->step();
      const __m512i a0 = _mm512_loadu_si512(rows[t] + s), a1 = _mm512_loadu_si512(rows[t] + s + 32);
      const __m512i b0 = _mm512_loadu_si512(rows[t + 1] + s);
      const __m512i b1 = _mm512_loadu_si512(rows[t + 1] + s + 32);
      const __m512bh x[4] = {(__m512bh)_mm512_unpacklo_epi16(b0, a0),
                             (__m512bh)_mm512_unpackhi_epi16(b0, a0),
                             (__m512bh)_mm512_unpacklo_epi16(b1, a1),
                             (__m512bh)_mm512_unpackhi_epi16(b1, a1)};
      pair_sums<NH>(acc, x, &pairs[0][0][0], t / 2, std::make_integer_sequence<int, 2 * NH * 4>{});
    }
    for (int r = 0; r < 2; ++r) {
      for (int h = 0; h < NH; ++h) {
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(st[r][h]->acc + s + 16 * j, acc[r][h][j]);
      }
    }
  }
  const float ones[NH] = {1.f, 1.f, 1.f};
  Prefetcher none;
  for (int r = 0; r < 2; ++r) {  // the later row's steps, as a row alone takes them
    if (counts[r] > both) {
      bf16_value_keys<D, NH>(pairs[r], rows, both, counts[r], ones, st[r], r == 1 ? pf : &none);
    }
  }
}

// The AVX2 loops' "+ 0" for a chunk's odd last key (bf16 value sums, above): every dim of the
// NH sums of one row
template <int D, int NH>
inline void add_zero_partner(State* const* st) {
  for (int h = 0; h < NH; ++h) {
    for (int d = 0; d < D; d += 8) {
      const __m256 sum = _mm256_loadu_ps(st[h]->acc + d);
      _mm256_storeu_ps(st[h]->acc + d, _mm256_add_ps(sum, _mm256_setzero_ps()));
    }
  }
}

// int8 caches: integer dot products. A query head enters as int16 codes and one float scale
// (quantize_query), so a score is an exact int32 sum of code products times two scales; a
// chunk's probabilities, each times its value row's scale, enter the value sums as int16 codes
// with one scale per (row, head, chunk), so those sums are exact int32 too. Only the float
// steps around the integer sums are ordered, and every loop (AVX2 and AVX-512, a row alone or
// in a tile, decoded or prefilled) takes the same ones:
//   query:   s_q = max|x| / 32767, codes round(x * (32767 / max|x|)) (half to even, within
//            +-32767; max|x| = 0: codes 0)
//   score:   (float(sum_i q_i k_i) * s_q) * (s_k * scale)
//   values:  w_t = p_t * s_v(t), s_w = max_t w_t / 32767, c_t = round(w_t * (32767 / max_t w_t));
//            acc = acc * correction + float(sum_t c_t v_t) * s_w
// The 15-bit codes' rounding (2^-16 of their largest) is ~1/256 of the cache's own 8-bit step.
// Every sum fits int32: 32767 x 127 x 256 (the largest head, and the largest chunk) < 2^31.
constexpr float kCodeMax = 32767.f;
constexpr int64_t kMaxChunkKeys = kMaxBlock;  // a chunk: kChunkTokens keys, or one block

#define AGENTX_AVX512VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

// x rounded to the nearest integer (half to even), within [lo, hi], as int32
inline __m256i code8(__m256 x, float lo, float hi) {
  x = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
  return _mm256_cvtps_epi32(x);
}

// n floats x (a multiple of 16) whose largest magnitude is amax as int16 codes at out:
// round(x * (32767 / amax)) within [lo, 32767]; all 0 where amax is 0. Returns their scale,
// amax / 32767.
float to_codes16(const float* x, int64_t n, float amax, float lo, int16_t* out) {
  if (!(amax > 0.f)) {
    std::memset(out, 0, n * sizeof(int16_t));
    return amax / kCodeMax;
  }
  const __m256 inv = _mm256_set1_ps(kCodeMax / amax);
  for (int64_t i = 0; i < n; i += 16) {
    const __m256i a = code8(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv), lo, kCodeMax);
    const __m256i b = code8(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), inv), lo, kCodeMax);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
  }
  return amax / kCodeMax;
}

// A query head of d floats (a multiple of 16) as int16 codes at out (d / 2 floats' room) and
// its scale at out[d / 2]: the head's slot of d floats (out is not x).
void quantize_query(const float* x, int64_t d, float* out) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude));
  }
  const float s = to_codes16(x, d, hmax(vmax), -kCodeMax, reinterpret_cast<int16_t*>(out));
  std::memcpy(out + d / 2, &s, sizeof(s));
}

template <int D>
inline const int16_t* query_codes(const float* q, int h) {
  return reinterpret_cast<const int16_t*>(q + h * D);
}
template <int D>
inline float query_scale(const float* q, int h) {
  return q[h * D + D / 2];
}

// one key's score for one head (the tail loops): the integer sum, then the float steps
template <int D>
inline float int8_score_one(const float* q, int h, const int8_t* k, float scale) {
  const int16_t* c = query_codes<D>(q, h);
  int32_t dot = 0;
  for (int i = 0; i < D; ++i) dot += static_cast<int32_t>(c[i]) * k[i];
  return (static_cast<float>(dot) * query_scale<D>(q, h)) * (row_scale<D>(k) * scale);
}

// Scores of keys [0, count) (kb, ts apart) for NH heads of one row, AVX2: four keys at a time,
// 16 dims a multiply-add (vpmaddwd), the keys' lanes summed by hadd.
template <int D, int NH>
inline void int8_scores(const float* q, const int8_t* kb, int64_t count, int64_t ts, float scale,
                        float* score) {
  int64_t t = 0;
  for (; t + 4 <= count; t += 4) {
    const int8_t* k = kb + t * ts;
    const __m128 ks = _mm_mul_ps(_mm_setr_ps(row_scale<D>(k), row_scale<D>(k + ts),
                                             row_scale<D>(k + 2 * ts), row_scale<D>(k + 3 * ts)),
                                 _mm_set1_ps(scale));
    for (int h = 0; h < NH; ++h) {
      const int16_t* c = query_codes<D>(q, h);
      __m256i acc[4];
      for (int j = 0; j < 4; ++j) {
        acc[j] = _mm256_setzero_si256();
        for (int i = 0; i < D; i += 16) {
          const __m256i kv = _mm256_cvtepi8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(k + j * ts + i)));
          const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i));
          acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(kv, qv));
        }
      }
      const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]),
                                          _mm256_hadd_epi32(acc[2], acc[3]));
      const __m128i dots = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      const __m128 f = _mm_mul_ps(_mm_cvtepi32_ps(dots), _mm_set1_ps(query_scale<D>(q, h)));
      _mm_storeu_ps(score + h * kScoreStride + t, _mm_mul_ps(f, ks));
    }
  }
  for (; t < count; ++t) {
    for (int h = 0; h < NH; ++h) {
      score[h * kScoreStride + t] = int8_score_one<D>(q, h, kb + t * ts, scale);
    }
  }
}

// AVX-512: eight keys at a time, 32 dims a vpdpwssd; each head's eight registers of 16 lanes
// fold pairwise into one as they come (two keys' lanes into one register, then four keys',
// then eight keys' two lanes each).
template <int D, int NH>
AGENTX_AVX512VNNI void int8_scores_avx512(const float* q, const int8_t* kb, int64_t count,
                                          int64_t ts, float scale, float* score) {
  const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  int64_t t = 0;
  for (; t + 8 <= count; t += 8) {
    const int8_t* k = kb + t * ts;
    __m512i four[NH][2], two[NH];
    for (int i = 0; i < 4; ++i) {  // keys 2i and 2i + 1
      __m512i ka[D / 32], kb2[D / 32];
      for (int c = 0; c < D / 32; ++c) {
        ka[c] = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + 2 * i * ts + 32 * c)));
        kb2[c] = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + (2 * i + 1) * ts + 32 * c)));
      }
      for (int h = 0; h < NH; ++h) {
        const int16_t* qc = query_codes<D>(q, h);
        __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
        for (int c = 0; c < D / 32; ++c) {
          const __m512i qv = _mm512_loadu_si512(qc + 32 * c);
          a = _mm512_dpwssd_epi32(a, ka[c], qv);
          b = _mm512_dpwssd_epi32(b, kb2[c], qv);
        }
        // [key 2i's 8 lanes | key 2i + 1's 8]
        const __m512i p = _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x44),
                                           _mm512_shuffle_i32x4(a, b, 0xEE));
        if (i % 2 == 0) {
          two[h] = p;
        } else {  // four keys' 4 lanes each, a 128-bit quarter a key
          four[h][i / 2] = _mm512_add_epi32(_mm512_shuffle_i32x4(two[h], p, 0x88),
                                            _mm512_shuffle_i32x4(two[h], p, 0xDD));
        }
      }
    }
    __m256 ks = _mm256_setr_ps(row_scale<D>(k), row_scale<D>(k + ts), row_scale<D>(k + 2 * ts),
                               row_scale<D>(k + 3 * ts), row_scale<D>(k + 4 * ts),
                               row_scale<D>(k + 5 * ts), row_scale<D>(k + 6 * ts),
                               row_scale<D>(k + 7 * ts));
    ks = _mm256_mul_ps(ks, _mm256_set1_ps(scale));
    for (int h = 0; h < NH; ++h) {
      // quarter j: lanes 0 and 2 hold keys j and j + 4 (lanes 1 and 3 the same sums again)
      __m512i r = _mm512_add_epi32(_mm512_unpacklo_epi64(four[h][0], four[h][1]),
                                   _mm512_unpackhi_epi64(four[h][0], four[h][1]));
      r = _mm512_add_epi32(r, _mm512_shuffle_epi32(r, _MM_PERM_CDAB));
      const __m256i dots = _mm512_castsi512_si256(_mm512_permutexvar_epi32(first, r));
      const __m256 f =
          _mm256_mul_ps(_mm256_cvtepi32_ps(dots), _mm256_set1_ps(query_scale<D>(q, h)));
      _mm256_storeu_ps(score + h * kScoreStride + t, _mm256_mul_ps(f, ks));
    }
  }
  if (t < count) int8_scores<D, NH>(q, kb + t * ts, count - t, ts, scale, score + t);
}

// A chunk's value rows (its segments in order, then a zero row where the count is odd) and,
// per head, its weights' codes (in pairs: codes[h][2j], codes[h][2j + 1] as one int32) and
// scale, as the value loops below take them.
alignas(64) constexpr int8_t kZeroRow[256] = {};

// Each head's weights p_t * s_v(t) over `count` keys (sv: the value rows' scales, read to the
// next multiple of 16) as int16 codes, codes[h], and their scale, sw[h]
template <int NH>
inline void int8_weight_codes(const float* prob, const float* sv, int64_t count,
                              int16_t (*codes)[kMaxChunkKeys + 16], float* sw) {
  const int64_t padded = (count + 15) / 16 * 16;
  alignas(32) float w[kMaxChunkKeys + 16];
  for (int h = 0; h < NH; ++h) {
    const float* p = prob + h * kScoreStride;
    __m256 vmax = _mm256_setzero_ps();
    for (int64_t t = 0; t < padded; t += 8) {
      // past count: weight 0, whatever the score row and sv hold there
      const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(p + t), _mm256_load_ps(sv + t));
      const __m256 wt = _mm256_and_ps(x, tail_mask(count - t));
      _mm256_store_ps(w + t, wt);
      vmax = _mm256_max_ps(vmax, wt);
    }
    sw[h] = to_codes16(w, padded, hmax(vmax), 0.f, codes[h]);
  }
}

template <int D, int NH>
inline int64_t int8_weights(const float* prob, const Segment<int8_t>* segs, int64_t count,
                            int64_t ts, const int8_t** rows, int16_t (*codes)[kMaxChunkKeys + 16],
                            float* sw) {
  alignas(32) float sv[kMaxChunkKeys + 8];
  for (int64_t off = 0, g = 0; off < count; ++g) {
    const int64_t n = std::min(segs[g].count, count - off);
    for (int64_t t = 0; t < n; ++t) {
      rows[off + t] = segs[g].v + t * ts;
      sv[off + t] = row_scale<D>(rows[off + t]);
    }
    off += n;
  }
  rows[count] = kZeroRow;
  int8_weight_codes<NH>(prob, sv, count, codes, sw);
  return (count + 1) / 2;
}

// acc = acc * correction + float(sums) * s_w for 8 dims (the sums in dim order): a product
// each, then the add (the empty asm keeps them from fusing into an FMA)
inline void add_value_sums8(float* acc, __m256i sums, float correction, float sw) {
  __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc), _mm256_set1_ps(correction));
  __m256 b = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(sw));
  asm("" : "+x"(a), "+x"(b));
  _mm256_storeu_ps(acc, _mm256_add_ps(a, b));
}

// The value sums of NH heads of one row over a chunk's first `count` keys, AVX2: the keys in
// pairs (vpmaddwd: two keys' codes times their weights' codes, a dword a dim), 16 dims a pass.
template <int D, int NH>
inline void int8_values(const float* prob, const Segment<int8_t>* segs, int64_t count,
                        int64_t ts, const float* correction, State* const* st,
                        Prefetcher* pf_home) {
  PrefetchScope pf_scope(pf_home);
  Prefetcher* pf = &pf_scope.f;
  const int8_t* rows[kMaxChunkKeys + 1];
  alignas(32) int16_t codes[NH][kMaxChunkKeys + 16];
  float sw[NH];
  const int64_t pairs = int8_weights<D, NH>(prob, segs, count, ts, rows, codes, sw);
  for (int s = 0; s < D; s += 16) {
    __m256i lo[NH], hi[NH];  // dims s + [0, 4) and [8, 12); s + [4, 8) and [12, 16)
    for (int h = 0; h < NH; ++h) lo[h] = hi[h] = _mm256_setzero_si256();
    for (int64_t j = 0; j < pairs; ++j) {
      if (s % 32 == 0) pf->step();  // once a key pair and 32 dims, as attend_tile counts
      const __m256i a = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * j] + s)));
      const __m256i b = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * j + 1] + s)));
      const __m256i x0 = _mm256_unpacklo_epi16(a, b), x1 = _mm256_unpackhi_epi16(a, b);
      for (int h = 0; h < NH; ++h) {
        int32_t pair;
        std::memcpy(&pair, codes[h] + 2 * j, sizeof(pair));
        const __m256i w = _mm256_set1_epi32(pair);
        lo[h] = _mm256_add_epi32(lo[h], _mm256_madd_epi16(x0, w));
        hi[h] = _mm256_add_epi32(hi[h], _mm256_madd_epi16(x1, w));
      }
    }
    for (int h = 0; h < NH; ++h) {
      add_value_sums8(st[h]->acc + s, _mm256_permute2x128_si256(lo[h], hi[h], 0x20),
                      correction[h], sw[h]);
      add_value_sums8(st[h]->acc + s + 8, _mm256_permute2x128_si256(lo[h], hi[h], 0x31),
                      correction[h], sw[h]);
    }
  }
}

// acc * correction + float(sums) * s_w, a product each, then the add (the empty asm keeps them
// from fusing into an FMA), for one pass's value sums of NH heads (R registers a head, dims
// s .. s + 16 R; lane 4L + i of an unpacked pair holds dim 8L + i (lo) or 8L + 4 + i (hi) of
// its 32)
template <int NH, int R>
AGENTX_AVX512VNNI __attribute__((always_inline)) inline void add_value_sums_avx512(
    const __m512i (&acc)[NH][R], int s, const float* correction, const float* sw,
    State* const* st) {
  const __m512i dims_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i dims_hi =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int h = 0; h < NH; ++h) {
    for (int c = 0; c < R / 2; ++c) {
      const __m512i ordered[2] = {
          _mm512_permutex2var_epi32(acc[h][2 * c], dims_lo, acc[h][2 * c + 1]),
          _mm512_permutex2var_epi32(acc[h][2 * c], dims_hi, acc[h][2 * c + 1])};
      for (int u = 0; u < 2; ++u) {
        float* dst = st[h]->acc + s + 32 * c + 16 * u;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(dst), _mm512_set1_ps(correction[h]));
        __m512 b = _mm512_mul_ps(_mm512_cvtepi32_ps(ordered[u]), _mm512_set1_ps(sw[h]));
        asm("" : "+v"(a), "+v"(b));
        _mm512_storeu_ps(dst, _mm512_add_ps(a, b));
      }
    }
  }
}

// int8_values for AVX-512 (VNNI): 64 dims a pass (32 with more than 3 heads: the registers),
// one vpdpwssd a 16 dims, key pair and head; the same sums, so the same bits.
template <int D, int NH>
AGENTX_AVX512VNNI void int8_values_avx512(const float* prob, const Segment<int8_t>* segs,
                                          int64_t count, int64_t ts, const float* correction,
                                          State* const* st, Prefetcher* pf_home) {
  PrefetchScope pf_scope(pf_home);
  Prefetcher* pf = &pf_scope.f;
  constexpr int P = NH > 3 ? 32 : 64;  // dims a pass
  constexpr int R = P / 16;  // registers a head
  const int8_t* rows[kMaxChunkKeys + 1];
  alignas(64) int16_t codes[NH][kMaxChunkKeys + 16];
  float sw[NH];
  const int64_t pairs = int8_weights<D, NH>(prob, segs, count, ts, rows, codes, sw);
  for (int s = 0; s < D; s += P) {
    __m512i acc[NH][R];
    for (int h = 0; h < NH; ++h) {
      for (int i = 0; i < R; ++i) acc[h][i] = _mm512_setzero_si512();
    }
    for (int64_t j = 0; j < pairs; ++j) {
      if (s % 64 == 0) pf->step();  // once a key pair and 64 dims, as attend_tile counts
      __m512i x[R];
      for (int c = 0; c < R / 2; ++c) {
        const __m512i a = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[2 * j] + s + 32 * c)));
        const __m512i b = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[2 * j + 1] + s + 32 * c)));
        x[2 * c] = _mm512_unpacklo_epi16(a, b);
        x[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
      }
      for (int h = 0; h < NH; ++h) {
        int32_t pair;
        std::memcpy(&pair, codes[h] + 2 * j, sizeof(pair));
        const __m512i w = _mm512_set1_epi32(pair);
        for (int i = 0; i < R; ++i) acc[h][i] = _mm512_dpwssd_epi32(acc[h][i], x[i], w);
      }
    }
    add_value_sums_avx512<NH, R>(acc, s, correction, sw, st);
  }
}

// The online softmax step of NH heads over a chunk's `count` scores each (head h's at
// sc + h kScoreStride, replaced by their exps): each head's max and denominator move on and
// correction[h] is the factor its earlier value sums take. Per head the steps below, the heads
// side by side in each: their chains are independent, and one head after another (each head's
// max, exp and sum waiting on the one before) a 2K prompt's 512-row tile took 2-3% longer.
template <bool Wide, int NH>
inline void softmax_heads(float* sc, int64_t count, State* const* st, float* correction) {
  // the max is exact in any order; the sum of exps runs in eight lanes, then hsum's tree
  __m256 vmax[NH];
  for (int h = 0; h < NH; ++h) vmax[h] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= count; t += 8) {
    for (int h = 0; h < NH; ++h) {
      vmax[h] = _mm256_max_ps(vmax[h], _mm256_load_ps(sc + h * kScoreStride + t));
    }
  }
  float new_max[NH];
  for (int h = 0; h < NH; ++h) {
    const float* x = sc + h * kScoreStride;
    float block_max = hmax(vmax[h]);
    for (int64_t u = t; u < count; ++u) block_max = x[u] > block_max ? x[u] : block_max;
    new_max[h] = block_max > st[h]->max ? block_max : st[h]->max;
  }
  for (int h = 0; h < NH; ++h) correction[h] = std::exp(st[h]->max - new_max[h]);
  __m256 sum[NH];
  for (int h = 0; h < NH; ++h) sum[h] = _mm256_setzero_ps();
  t = 0;
  if constexpr (Wide) t = exp_sum16<NH>(sc, count, new_max, sum);
  for (; t < count; t += 8) {
    for (int h = 0; h < NH; ++h) {
      float* x = sc + h * kScoreStride;
      const __m256 e =
          exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(x + t), _mm256_set1_ps(new_max[h])));
      _mm256_store_ps(x + t, e);
      sum[h] = _mm256_add_ps(sum[h], count - t >= 8 ? e : _mm256_and_ps(e, tail_mask(count - t)));
    }
  }
  for (int h = 0; h < NH; ++h) {
    // rounded product, then the add: kept from fusing into one FMA (which GCC does or not
    // depending on where this is inlined, so the bits would follow the inliner)
    float scaled = st[h]->denom * correction[h];
    asm("" : "+x"(scaled));
    st[h]->denom = scaled + hsum(sum[h]);
    st[h]->max = new_max[h];
  }
}

// The scores of the first `count` keys of one chunk (its segments in order) for NH heads of one
// row, then each head's online softmax step: score[h] holds the exps, correction[h] the factor
// its earlier value sums take.
template <typename T, int D, int NH, bool Wide>
inline void chunk_softmax(const float* q, const Segment<T>* segs, int64_t count, int64_t ts,
                          float scale, float* score, State* const* st, float* correction,
                          Prefetcher* pf, const uint32_t* kt = nullptr) {
  if constexpr (std::is_same_v<T, at::BFloat16> && Wide) {
    if (kt != nullptr) bf16_scores_kt<D, NH>(q, kt, count, scale, score);
  }
  for (int64_t off = 0, s = 0; kt == nullptr && off < count; ++s) {
    const int64_t n = std::min(segs[s].count, count - off);
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if constexpr (Wide) {
        bf16_scores_avx512<D, NH>(q, segs[s].k, n, ts, scale, score + off, pf);
      } else {
        bf16_scores<D, NH>(q, segs[s].k, n, ts, scale, score + off, pf);
      }
    } else if constexpr (kInt8<T> && Wide) {
      int8_scores_avx512<D, NH>(q, segs[s].k, n, ts, scale, score + off);
    } else if constexpr (kInt8<T>) {
      int8_scores<D, NH>(q, segs[s].k, n, ts, scale, score + off);
    } else if constexpr (Wide) {
      row_scores_avx512<T, D, NH>(q, segs[s].k, n, ts, scale, score + off);
    } else {
      row_scores<T, D, NH>(q, segs[s].k, n, ts, scale, score + off);
    }
    off += n;
  }
  softmax_heads<Wide, NH>(score, count, st, correction);
  // bf16 value sums: the AVX2 loops weigh by the probabilities rounded (the AVX-512 loop rounds
  // them as it packs them in pairs)
  if constexpr (std::is_same_v<T, at::BFloat16> && !Wide) {
    for (int h = 0; h < NH; ++h) {
      round_to_bf16(score + h * kScoreStride, count, score + h * kScoreStride);
    }
  }
}

// The first `count` keys of one chunk (its segments in order) for NH heads of one row: the
// online softmax update. Scores are per key, so they are computed segment by segment; the
// value sums run one FMA chain over the chunk's keys in order, later segments continuing it
// (their correction is 1, exact).
template <typename T, int D, int NH, bool Wide>
inline void fold_chunk(const float* q, const Segment<T>* segs, int64_t count, int64_t ts,
                       float scale, float* score, State* const* st, Prefetcher* pf,
                       const uint32_t* kt = nullptr) {
  float correction[NH];
  chunk_softmax<T, D, NH, Wide>(q, segs, count, ts, scale, score, st, correction, pf, kt);
  if constexpr (Wide && std::is_same_v<T, at::BFloat16>) {
    bf16_values_avx512<D, NH>(score, segs, count, ts, correction, st, pf);
  } else if constexpr (kInt8<T> && Wide) {
    int8_values_avx512<D, NH>(score, segs, count, ts, correction, st, pf);
  } else if constexpr (kInt8<T>) {
    int8_values<D, NH>(score, segs, count, ts, correction, st, pf);
  } else if constexpr (Wide) {
    row_values_avx512<T, D, NH>(score, segs, count, ts, correction, st, pf);
  } else {
    float ones[NH];
    for (int h = 0; h < NH; ++h) ones[h] = 1.f;
    for (int64_t off = 0, s = 0; off < count; ++s) {
      const int64_t n = std::min(segs[s].count, count - off);
      const float* c = off == 0 ? correction : ones;
      if constexpr (std::is_same_v<T, at::BFloat16> && NH == 3) {
        row_values_bf16x3<D>(score + off, segs[s].v, n, ts, c, st, pf);
      } else {
        row_values<T, D, NH>(score + off, segs[s].v, n, ts, c, st, pf);
      }
      off += n;
    }
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (count & 1) add_zero_partner<D, NH>(st);
    }
  }
}

// Three heads of two rows over bf16 values, AVX2: row_values for both at once, each row's sums
// the same FMA chains (keys in order; the row with more keys, n0 or n1, takes its last ones
// alone). One row's six accumulators would leave each FMA waiting on its own chain's previous
// one (a chain per key); two rows' twelve keep both FMA units busy and share each V load.
template <int D>
inline void pair_values(const float* const* prob, const at::BFloat16* vb, const int64_t* n,
                        int64_t ts, const float* const* correction, State* const* const* st,
                        Prefetcher* pf_home) {
  PrefetchScope pf_scope(pf_home);
  Prefetcher* pf = &pf_scope.f;
  constexpr int NH = 3;
  const int64_t both = std::min(n[0], n[1]), longer = n[1] > n[0] ? 1 : 0;
  for (int s = 0; s < D; s += 32) {
    for (int part = 0; part < 2; ++part) {
      const auto reg = [part](int i) { return kHalfReg<at::BFloat16>(part, i); };
      __m256 acc[2][NH][2];
      for (int r = 0; r < 2; ++r) {
        for (int h = 0; h < NH; ++h) {
          const __m256 c = _mm256_set1_ps(correction[r][h]);
          for (int i = 0; i < 2; ++i) {
            acc[r][h][i] = _mm256_mul_ps(_mm256_loadu_ps(st[r][h]->acc + s + 8 * reg(i)), c);
          }
        }
      }
      int64_t t = 0;
      for (; t < both; ++t) {
        if (part == 0) pf->step();  // once a key and slice, as row_values does
        __m256 vv[2];
        load_values8_half(vb + t * ts + s, part, vv);
        for (int r = 0; r < 2; ++r) {
          for (int h = 0; h < NH; ++h) {
            const __m256 p = _mm256_set1_ps(prob[r][h * kScoreStride + t]);
            for (int i = 0; i < 2; ++i) acc[r][h][i] = _mm256_fmadd_ps(p, vv[i], acc[r][h][i]);
          }
        }
      }
      // the longer row's last keys alone: the loop above for one row (one body for both
      // through a shared lambda took the accumulators out of registers: 64-row tiles 45% slower)
      const auto tail = [&](auto row) {
        constexpr int r = decltype(row)::value;
        for (int64_t u = t; u < n[r]; ++u) {
          if (part == 0) pf->step();
          __m256 vv[2];
          load_values8_half(vb + u * ts + s, part, vv);
          for (int h = 0; h < NH; ++h) {
            const __m256 p = _mm256_set1_ps(prob[r][h * kScoreStride + u]);
            for (int i = 0; i < 2; ++i) acc[r][h][i] = _mm256_fmadd_ps(p, vv[i], acc[r][h][i]);
          }
        }
      };
      if (longer == 1) {
        tail(std::integral_constant<int, 1>{});
      } else {
        tail(std::integral_constant<int, 0>{});
      }
      for (int r = 0; r < 2; ++r) {
        for (int h = 0; h < NH; ++h) {
          for (int i = 0; i < 2; ++i) {
            _mm256_storeu_ps(st[r][h]->acc + s + 8 * reg(i), acc[r][h][i]);
          }
        }
      }
    }
  }
}

// fold_chunk for three heads of two rows of a tile (counts[r] keys each, > 0) over bf16, AVX2:
// each row's scores and softmax as fold_chunk takes them, then their value sums together
// (pair_values): every row's arithmetic as fold_chunk's.
template <int D>
inline void fold_chunk_pair(const float* const* q, const Segment<at::BFloat16>* segs,
                            const int64_t* counts, int64_t ts, float scale, float* const* score,
                            State* const* const* st, Prefetcher* pf) {
  constexpr int NH = 3;
  float correction[2][NH];
  Prefetcher none;
  for (int r = 0; r < 2; ++r) {
    chunk_softmax<at::BFloat16, D, NH, false>(q[r], segs, counts[r], ts, scale, score[r], st[r],
                                              correction[r], r == 1 ? pf : &none);
  }
  const float ones[NH] = {1.f, 1.f, 1.f};
  const int64_t count = std::max(counts[0], counts[1]);
  for (int64_t off = 0, s = 0; off < count; ++s) {
    int64_t n[2];
    for (int r = 0; r < 2; ++r) n[r] = std::clamp<int64_t>(counts[r] - off, 0, segs[s].count);
    const float* c[2] = {off == 0 ? correction[0] : ones, off == 0 ? correction[1] : ones};
    const float* p[2] = {score[0] + off, score[1] + off};
    pair_values<D>(p, segs[s].v, n, ts, c, st, pf);
    off += segs[s].count;
  }
  for (int r = 0; r < 2; ++r) {
    if (counts[r] & 1) add_zero_partner<D, NH>(st[r]);
  }
}

// fold_chunk for three heads of two rows of a tile (counts[r] keys each, > 0) over bf16, AVX-512
// with a transposed chunk: each row's scores and softmax as fold_chunk takes them, then their
// value sums together (bf16_values_pair): every row's arithmetic as fold_chunk's.
template <int D>
AGENTX_AVX512BF16 void fold_chunk_pair_wide(const float* const* q,
                                            const Segment<at::BFloat16>* segs,
                                            const int64_t* counts, int64_t ts, float scale,
                                            float* const* score, State* const* const* st,
                                            Prefetcher* pf, const uint32_t* kt) {
  constexpr int NH = 3;
  float correction[2][NH];
  for (int r = 0; r < 2; ++r) {
    chunk_softmax<at::BFloat16, D, NH, true>(q[r], segs, counts[r], ts, scale, score[r], st[r],
                                             correction[r], pf, kt);
  }
  const float* p[2] = {score[0], score[1]};
  const float* c[2] = {correction[0], correction[1]};
  bf16_values_pair<D>(p, segs, counts, ts, c, st, pf);
}

// int8 tiles (AVX-512 VNNI): a tile's rows share each chunk's K and V, so one KV head's chunk
// is unpacked once for them all (Int8Chunk), not once a row: its K codes transposed as int16
// pairs (kt[p * kKtKeys + t]: key t's dims 2p and 2p + 1), so a register holds 16 keys' exact
// sums (vpdpwssd with the query's dword p broadcast; no lanes to fold), and its V codes as the
// key pairs' interleaved int16 registers that int8_values_avx512 builds for every row. The
// integer sums are the same integers and the float steps around them the same operations, so
// every score and value sum is the one-row loops', bit for bit.
struct Int8Chunk {
  alignas(64) uint32_t kt[128 * kKtKeys];  // D / 2 dwords a key (D <= 256)
  alignas(64) int32_t vx[kKtKeys / 2 * 256];  // a key pair's D / 16 registers, D dwords
  alignas(64) float ksc[kKtKeys];  // a key's row scale times the softmax scale; 0 past count
  alignas(64) float sv[kKtKeys + 16];  // a value row's scale; 0 past count
};

// This thread's Int8Chunk (~65 KB), made at its first int8 tile, not in every thread's TLS
Int8Chunk* thread_int8_chunk() {
  thread_local std::unique_ptr<Int8Chunk> chunk;
  if (!chunk) chunk = std::make_unique<Int8Chunk>();
  return chunk.get();
}

// acc += the dword products of x and w (int16 pairs), as _mm512_dpwssd_epi32: through asm
// because GCC kept the intrinsic's accumulators moving between registers every step of a loop
// of twelve (a zmm copy per vpdpwssd)
AGENTX_AVX512VNNI __attribute__((always_inline)) inline void dpwssd(__m512i& acc, __m512i x,
                                                                    __m512i w) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
}

// The first `count` (<= kKtKeys) keys of a chunk (its segments in order) for one KV head into c.
template <int D>
AGENTX_AVX512VNNI void int8_chunk(const Segment<int8_t>* segs, int64_t count, int64_t ts,
                                  float scale, Int8Chunk* c) {
  const int8_t* k[kKtKeys];
  const int8_t* v[kKtKeys + 1];
  for (int64_t off = 0, s = 0; off < count; ++s) {
    const int64_t n = std::min(segs[s].count, count - off);
    for (int64_t t = 0; t < n; ++t) {
      k[off + t] = segs[s].k + t * ts;
      v[off + t] = segs[s].v + t * ts;
    }
    off += n;
  }
  v[count] = kZeroRow;
  for (int64_t t = 0; t < kKtKeys; ++t) {
    c->ksc[t] = t < count ? row_scale<D>(k[t]) * scale : 0.f;
    c->sv[t] = t < count ? row_scale<D>(v[t]) : 0.f;
  }
  for (int64_t t0 = 0; t0 < count; t0 += 16) {
    for (int g = 0; g < D / 32; ++g) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = t0 + i < count ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(k[t0 + i] + 32 * g)))
                              : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int p = 0; p < 16; ++p) _mm512_store_si512(c->kt + (16 * g + p) * kKtKeys + t0, r[p]);
    }
  }
  for (int64_t j = 0; j < (count + 1) / 2; ++j) {
    for (int g = 0; g < D / 32; ++g) {
      const __m512i a = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[2 * j] + 32 * g)));
      const __m512i b = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[2 * j + 1] + 32 * g)));
      _mm512_store_si512(c->vx + j * D + 32 * g, _mm512_unpacklo_epi16(a, b));
      _mm512_store_si512(c->vx + j * D + 32 * g + 16, _mm512_unpackhi_epi16(a, b));
    }
  }
}

// int8_scores_avx512's scores of keys [0, 16 G) for NH heads of one row, from c's kt
template <int D, int NH, int G>
AGENTX_AVX512VNNI __attribute__((always_inline)) inline void int8_scores_kt_block(
    const float* q, const Int8Chunk* c, float* score) {
  __m512i acc[NH][G];
  for (int h = 0; h < NH; ++h) {
    for (int g = 0; g < G; ++g) acc[h][g] = _mm512_setzero_si512();
  }
#pragma GCC unroll 4
  for (int p = 0; p < D / 2; ++p) {
    __m512i k[G];
    for (int g = 0; g < G; ++g) k[g] = _mm512_load_si512(c->kt + p * kKtKeys + 16 * g);
    for (int h = 0; h < NH; ++h) {
      int32_t qd;
      std::memcpy(&qd, query_codes<D>(q, h) + 2 * p, sizeof(qd));
      const __m512i qv = _mm512_set1_epi32(qd);
      for (int g = 0; g < G; ++g) acc[h][g] = _mm512_dpwssd_epi32(acc[h][g], k[g], qv);
    }
  }
  for (int h = 0; h < NH; ++h) {
    const __m512 sq = _mm512_set1_ps(query_scale<D>(q, h));
    for (int g = 0; g < G; ++g) {
      const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[h][g]), sq);
      _mm512_storeu_ps(score + h * kScoreStride + 16 * g,
                       _mm512_mul_ps(f, _mm512_load_ps(c->ksc + 16 * g)));
    }
  }
}

// the scores of keys [0, count) (and up to the next multiple of 16, past count: zeros' or the
// chunk's later keys', which the softmax and weights mask) for NH heads of one row
template <int D, int NH>
AGENTX_AVX512VNNI inline void int8_scores_kt(const float* q, const Int8Chunk* c, int64_t count,
                                             float* score) {
  switch ((count + 15) / 16) {
    case 4: int8_scores_kt_block<D, NH, 4>(q, c, score); break;
    case 3: int8_scores_kt_block<D, NH, 3>(q, c, score); break;
    case 2: int8_scores_kt_block<D, NH, 2>(q, c, score); break;
    default: int8_scores_kt_block<D, NH, 1>(q, c, score); break;
  }
}

// int8_values_avx512 over c's unpacked pairs: the same weights' codes and sums. Fetch: the row
// that fetches the next chunks (a tile's last) takes the Prefetcher steps; the other rows' loop
// has none (with them in every row's loop, GCC moved the twelve accumulators between
// registers every key pair).
template <int D, int NH, bool Fetch>
AGENTX_AVX512VNNI inline void int8_values_kt(const float* prob, const Int8Chunk* c,
                                             int64_t count, const float* correction,
                                             State* const* st, Prefetcher* pf_home) {
  PrefetchScope pf_scope(pf_home);
  Prefetcher* pf = &pf_scope.f;
  constexpr int P = NH > 3 ? 32 : 64;  // dims a pass
  constexpr int R = P / 16;  // registers a head
  alignas(64) int16_t codes[NH][kMaxChunkKeys + 16];
  float sw[NH];
  int8_weight_codes<NH>(prob, c->sv, count, codes, sw);
  const int64_t pairs = (count + 1) / 2;
  for (int s = 0; s < D; s += P) {
    __m512i acc[NH][R];
    for (int h = 0; h < NH; ++h) {
      for (int i = 0; i < R; ++i) acc[h][i] = _mm512_setzero_si512();
    }
    for (int64_t j = 0; j < pairs; ++j) {
      if (Fetch && s % 64 == 0) pf->step();  // once a key pair and 64 dims, as attend_tile counts
      __m512i x[R];
      for (int i = 0; i < R; ++i) x[i] = _mm512_load_si512(c->vx + j * D + s + 16 * i);
      for (int h = 0; h < NH; ++h) {
        int32_t pair;
        std::memcpy(&pair, codes[h] + 2 * j, sizeof(pair));
        const __m512i wv = _mm512_set1_epi32(pair);
        for (int i = 0; i < R; ++i) dpwssd(acc[h][i], wv, x[i]);
      }
    }
    add_value_sums_avx512<NH, R>(acc, s, correction, sw, st);
  }
}

// fold_heads for one row of an int8 tile over an unpacked chunk: fold_chunk's steps per pass
// of heads (the same passes), its loops replaced by the ones above
template <int D, bool Fetch>
AGENTX_AVX512VNNI void fold_heads_int8(const float* q, const Int8Chunk* c, int64_t count,
                                       float* score, State* st, int64_t group, Prefetcher* pf) {
  State* ptrs[6];  // kHeadsAPass<true> (below): passes of 6 heads, else 3
  float correction[6];
  for (int64_t g = 0; g < group;) {
    const int64_t nh = std::min<int64_t>(group - g >= 6 ? 6 : 3, group - g);
    for (int64_t h = 0; h < nh; ++h) ptrs[h] = st + g + h;
    const float* qg = q + g * D;
    g += nh;
    const auto pass = [&](auto heads) {
      constexpr int NH = decltype(heads)::value;
      int8_scores_kt<D, NH>(qg, c, count, score);
      softmax_heads<true, NH>(score, count, ptrs, correction);
      int8_values_kt<D, NH, Fetch>(score, c, count, correction, ptrs, pf);
    };
    switch (nh) {
      case 6: pass(std::integral_constant<int, 6>{}); break;
      case 3: pass(std::integral_constant<int, 3>{}); break;
      case 2: pass(std::integral_constant<int, 2>{}); break;
      default: pass(std::integral_constant<int, 1>{}); break;
    }
  }
}

// The segments of one KV head: the same keys, `head` elements further into each token row.
template <typename T>
inline void head_segments(const Segment<T>* segs, int64_t nsegs, int64_t head, Segment<T>* out) {
  for (int64_t s = 0; s < nsegs; ++s) out[s] = {segs[s].k + head, segs[s].v + head, segs[s].count};
}

// Query heads a pass over one KV head's keys: each K/V load serves all of them. AVX-512 has
// the registers for 6 (row_values: 24 accumulators; Qwen2.5's group of 6 in one pass, not
// two), AVX2 for 3. Every head's arithmetic is the same either way.
template <bool Wide>
constexpr int64_t kHeadsAPass = Wide ? 6 : 3;

template <typename T, int D, bool Wide>
inline void fold_heads(const float* q, const Segment<T>* segs, int64_t count, int64_t ts,
                       float scale, float* score, State* st, int64_t group, Prefetcher* pf,
                       const uint32_t* kt = nullptr) {
  State* ptrs[kHeadsAPass<Wide>];
  for (int64_t g = 0; g < group;) {
    const int64_t nh = std::min<int64_t>(group - g >= 6 ? kHeadsAPass<Wide> : 3, group - g);
    for (int64_t h = 0; h < nh; ++h) ptrs[h] = st + g + h;
    const float* qg = q + g * D;
    g += nh;
    if constexpr (Wide) {
      if (nh == 6) {
        fold_chunk<T, D, 6, Wide>(qg, segs, count, ts, scale, score, ptrs, pf, kt);
        continue;
      }
    }
    if (nh == 3) {
      fold_chunk<T, D, 3, Wide>(qg, segs, count, ts, scale, score, ptrs, pf, kt);
    } else if (nh == 2) {
      fold_chunk<T, D, 2, Wide>(qg, segs, count, ts, scale, score, ptrs, pf, kt);
    } else {
      fold_chunk<T, D, 1, Wide>(qg, segs, count, ts, scale, score, ptrs, pf, kt);
    }
  }
}

// fold_heads for two rows of a tile (bf16, AVX2): passes of three heads take fold_chunk_pair,
// the rest each row alone.
template <int D>
inline void fold_heads_pair(const float* const* q, const Segment<at::BFloat16>* segs,
                            const int64_t* counts, int64_t ts, float scale, float* const* score,
                            State* const* st, int64_t group, Prefetcher* pf) {
  using T = at::BFloat16;
  for (int64_t g = 0; g < group;) {
    const int64_t nh = std::min<int64_t>(3, group - g);
    if (nh == 3) {
      State* ptrs[2][3];
      for (int r = 0; r < 2; ++r) {
        for (int h = 0; h < 3; ++h) ptrs[r][h] = st[r] + g + h;
      }
      const float* qg[2] = {q[0] + g * D, q[1] + g * D};
      State* const* rows[2] = {ptrs[0], ptrs[1]};
      fold_chunk_pair<D>(qg, segs, counts, ts, scale, score, rows, pf);
    } else {  // the prefetches from the second row's calls only, as fold_heads counts them
      Prefetcher none;
      for (int r = 0; r < 2; ++r) {
        State* ptrs[2] = {st[r] + g, st[r] + g + 1};
        Prefetcher* fetch = r == 1 ? pf : &none;
        if (nh == 2) {
          fold_chunk<T, D, 2, false>(q[r] + g * D, segs, counts[r], ts, scale, score[r], ptrs,
                                     fetch);
        } else {
          fold_chunk<T, D, 1, false>(q[r] + g * D, segs, counts[r], ts, scale, score[r], ptrs,
                                     fetch);
        }
      }
    }
    g += nh;
  }
}

// Keys a chunk: the online softmax folds this many keys at a time (chunks are aligned to
// multiples of it from key 0 and span several blocks when blocks are smaller), so its
// per-chunk work (max, exps, rescaling) is paid once per 64 keys, not once per block.
constexpr int64_t kChunkTokens = 64;
constexpr int64_t kMaxSegments = kChunkTokens + 1;
// chunks fetched into L2 ahead of the one being read (2 beat 1 and 4 on the Zen 4 box, with the
// prefetches spread over the value loops: docs/BENCHMARKS.md, "Decode attention from DRAM")
constexpr int64_t kAheadChunks = 2;

// The blocks an item reads (table[first, end)) and how far the item before it on its thread
// fetched them (`next`, `offset`: its Prefetcher's position when it ended).
struct ItemBlocks {
  const int64_t* table;
  int64_t first;
  int64_t end;
  int64_t next;
  int64_t offset;
};

// Keys [lo, ends[tile_rows - 1]) for a tile of rows (ends[r]: row r's last key + 1,
// nondecreasing) and every KV head with the `group` query heads reading it, chunk by chunk:
// each chunk's K/V (whole token rows, all heads) comes from memory once for the whole tile.
// states: tile_rows x heads, row-major.
//
//   keys   lo          c*64        (c+1)*64          hi
//          |--chunk--|----chunk------|---- ... -----|
//          [blk][blk][blk][blk][blk]...   (blocks of block_size tokens, anywhere in memory)
//
// fetched, fetched_offset: how far the thread's previous item fetched this one's blocks; after:
// the thread's next item, whose first chunks this one fetches at its end (or nullptr).
template <typename T, int D, bool Wide>
void attend_tile(const float* q, int64_t q_row_stride, const T* cache, int64_t block_stride,
                 const int64_t* table, int64_t lo, const int64_t* ends, int64_t tile_rows,
                 int64_t block_size, int64_t num_kv_heads, int64_t group, float scale,
                 State* states, int64_t fetched, int64_t fetched_offset, ItemBlocks* after) {
  alignas(32) float score[kHeadsAPass<Wide> * kScoreStride];
  // two rows of a tile at a time where pair_values applies (bf16, AVX2), or bf16_values_pair
  // (AVX-512, KV groups of 3)
  constexpr bool kPairs = !Wide && std::is_same_v<T, at::BFloat16>;
  alignas(32) float score_pair[kPairs || (Wide && std::is_same_v<T, at::BFloat16>)
                                   ? 3 * kScoreStride
                                   : 1];
  const int64_t chunk = std::max(kChunkTokens, block_size);
  const int64_t row = D + kRowExtra<T>;  // one (token, KV head) row
  const int64_t token_stride = num_kv_heads * row, heads = num_kv_heads * group;
  constexpr bool kPaired = std::is_same_v<T, at::BFloat16>;  // bf16's paired order
  constexpr bool kTransposed = Wide && kPaired;  // tiles' scores from transposed chunks
  alignas(64) thread_local uint32_t kt_buffer[kTransposed ? 128 * kKtKeys : 1];  // D <= 256
  constexpr bool kInt8Tiles = Wide && kInt8<T>;  // tiles' chunks unpacked once (Int8Chunk)
  std::optional<FlushDenormals> flush;  // bf16: the float steps VDPBF16PS takes, on any CPU
  if constexpr (kPaired) {  // the tile's queries rounded to bf16: in paired order, or as bf16
    flush.emplace();
    thread_local std::vector<float> paired;
    if (static_cast<int64_t>(paired.size()) < tile_rows * heads * D) {
      paired.resize(tile_rows * heads * D);
    }
    for (int64_t r = 0; r < tile_rows; ++r) {  // q: rounded by run_rows
      for (int64_t h = 0; h < heads; ++h) {
        const float* src = q + r * q_row_stride + h * D;
        float* dst = paired.data() + (r * heads + h) * D;
        if constexpr (Wide) {  // bf16 values in dim order (VDPBF16PS's operand)
          to_bf16(src, D, reinterpret_cast<at::BFloat16*>(dst));
        } else {
          to_paired(src, D, dst);
        }
      }
    }
    q = paired.data();
    q_row_stride = heads * D;
  }
  const int64_t hi = ends[tile_rows - 1];
  Segment<T> segs[kMaxSegments], head_segs[kMaxSegments];
  // blocks are fetched into L2 kAheadChunks ahead of the chunk being read (the hardware
  // prefetcher does not follow the block table), a few lines per key of the loops
  const int64_t num_blocks = (hi - 1) / block_size + 1;
  Prefetcher pf;
  pf.cache = reinterpret_cast<const char*>(cache);
  pf.block_bytes = 2 * block_size * token_stride * static_cast<int64_t>(sizeof(T));
  pf.stride_bytes = block_stride * static_cast<int64_t>(sizeof(T));
  pf.table = table;
  pf.next = std::max(lo / block_size, fetched);
  pf.offset = pf.next == fetched ? fetched_offset : 0;
  int64_t fetch_end = num_blocks;  // then the next item's blocks, past this item's
  if (after != nullptr) {
    pf.split = num_blocks;
    pf.then = after->table + after->first;
    fetch_end += after->end - after->first;
  }
  Prefetcher idle;  // fetches nothing (want 0)
  for (int64_t start = lo; start < hi;) {
    const int64_t end = std::min(hi, (start / chunk + 1) * chunk);
    // kAheadChunks chunks past this one, in this item's blocks or then the next item's (the
    // keys past this item's end counted from the next one's first block)
    const int64_t past = end + kAheadChunks * chunk;
    const int64_t ahead = std::min(
        fetch_end, past <= hi ? (past - 1) / block_size + 1
                              : num_blocks + (past - hi + block_size - 1) / block_size);
    pf.finish();  // the previous chunk's share, if its loops ran short
    pf.limit = ahead;
    {
      // spread this chunk's share over the last row's loops (keys x heads calls; the
      // other rows of a tile read the same chunk, already on its way, and fetch nothing)
      const int64_t lines = ((ahead - pf.next) * pf.block_bytes - pf.offset + 63) / 64;
      int64_t calls = std::min(end, ends[tile_rows - 1]) - start;
      const int64_t passes =
          Wide && group >= 6 ? group / 6 + (group % 6 + 2) / 3 : (group + 2) / 3;
      // bf16 score loops call too: AVX2's always, AVX-512's where a row reads K untransposed
      const bool score_calls = std::is_same_v<T, at::BFloat16> &&
                               (!Wide || !(tile_rows > 1 && chunk <= kKtKeys));
      calls *= num_kv_heads * passes * ((Wide ? D / 64 : D / 32) + (score_calls ? 1 : 0));
      if constexpr (kInt8<T>) calls = (calls + 1) / 2;  // int8's value loops: a call a key pair
      pf.want = calls > 0 ? (lines + calls - 1) / calls : lines;
    }
    int64_t nsegs = 0;
    for (int64_t t = start; t < end;) {
      const int64_t b = t / block_size, seg_end = std::min(end, (b + 1) * block_size);
      const T* k = cache + table[b] * block_stride + (t - b * block_size) * token_stride;
      segs[nsegs++] = {k, k + block_size * token_stride, seg_end - t};
      t = seg_end;
    }
    // KV head outer, rows inner: one head's K and V of the chunk (2 x 8 KB of bf16 at head
    // dim 64) stay in L1 for the tile's rows; all heads' would not
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      head_segments<T>(segs, nsegs, h * row, head_segs);
      if constexpr (kInt8Tiles) {
        if (tile_rows > 1 && chunk <= kKtKeys) {
          Int8Chunk* c = thread_int8_chunk();
          int8_chunk<D>(head_segs, end - start, token_stride, scale, c);
          for (int64_t r = 0; r < tile_rows; ++r) {
            const int64_t count = std::min(end, ends[r]) - start;
            if (count <= 0) continue;
            const float* qr = q + r * q_row_stride + h * group * D;
            State* st = states + r * heads + h * group;
            if (r == tile_rows - 1) {
              fold_heads_int8<D, true>(qr, c, count, score, st, group, &pf);
            } else {
              fold_heads_int8<D, false>(qr, c, count, score, st, group, &idle);
            }
          }
          continue;
        }
      }
      const uint32_t* kt = nullptr;  // the chunk's K transposed, for a tile's rows (AVX-512 bf16)
      if constexpr (kTransposed) {
        if (tile_rows > 1 && chunk <= kKtKeys) {
          transpose_keys<D>(head_segs, end - start, token_stride, kt_buffer);
          kt = kt_buffer;
        }
      }
      for (int64_t r = 0; r < tile_rows;) {
        const int64_t count = std::min(end, ends[r]) - start;
        const float* qh = q + r * q_row_stride + h * group * D;
        State* st = states + r * heads + h * group;
        if constexpr (kPairs) {  // rows ends[] apart by one: counts > 0 from the first on
          if (count > 0 && r + 1 < tile_rows) {
            const int64_t counts[2] = {count, std::min(end, ends[r + 1]) - start};
            const float* qs[2] = {qh, qh + q_row_stride};
            float* scores[2] = {score, score_pair};
            State* sts[2] = {st, st + heads};
            Prefetcher* fetch = r + 1 == tile_rows - 1 ? &pf : &idle;
            fold_heads_pair<D>(qs, head_segs, counts, token_stride, scale, scores, sts, group,
                               fetch);
            r += 2;
            continue;
          }
        }
        if constexpr (kTransposed) {  // two rows at once where their group is 3 heads
          if (kt != nullptr && group == 3 && count > 0 && r + 1 < tile_rows) {
            const int64_t counts[2] = {count, std::min(end, ends[r + 1]) - start};
            const float* qs[2] = {qh, qh + q_row_stride};
            float* scores[2] = {score, score_pair};
            State* rows_st[2][3] = {{st, st + 1, st + 2},
                                    {st + heads, st + heads + 1, st + heads + 2}};
            State* const* sts[2] = {rows_st[0], rows_st[1]};
            Prefetcher* fetch = r + 1 == tile_rows - 1 ? &pf : &idle;
            fold_chunk_pair_wide<D>(qs, head_segs, counts, token_stride, scale, scores, sts,
                                    fetch, kt);
            r += 2;
            continue;
          }
        }
        if (count > 0) {
          Prefetcher* fetch = r == tile_rows - 1 ? &pf : &idle;
          fold_heads<T, D, Wide>(qh, head_segs, count, token_stride, scale, score, st, group,
                                 fetch, kt);
        }
        ++r;
      }
    }
    start = end;
  }
  if (after != nullptr) {  // where the next item's fetching stands
    after->next = pf.next <= num_blocks ? after->first : after->first + (pf.next - num_blocks);
    after->offset = pf.next < num_blocks ? 0 : pf.offset;
  }
  if constexpr (kPaired) {
    for (int64_t i = 0; i < tile_rows * heads; ++i) {
      if constexpr (Wide) {
        from_unpacked(states[i].acc, D);
      } else {
        from_paired(states[i].acc, D);
      }
    }
  }
}

template <typename T>
using TileFn = void (*)(const float*, int64_t, const T*, int64_t, const int64_t*, int64_t,
                        const int64_t*, int64_t, int64_t, int64_t, int64_t, float, State*,
                        int64_t, int64_t, ItemBlocks*);

template <typename T, bool Wide>
TileFn<T> tile_fn(int64_t head_dim) {
  switch (head_dim) {
    case 64: return &attend_tile<T, 64, Wide>;
    case 128: return &attend_tile<T, 128, Wide>;
    case 256: return &attend_tile<T, 256, Wide>;
    default: return nullptr;
  }
}

// Keys a split: long contexts are cut so that a few requests still keep every thread busy.
constexpr int64_t kSplitTokens = 512;
// Rows a tile: consecutive tokens of one request that share each K/V chunk (its transposed K
// and its V rows in L1). 16 against 8: a chunk of 256 rows at 2K keys 11.4 -> 10.7 ms on one
// Zen 4 thread, 32 rows 3-5% faster too; 32 a tile is faster still on one thread but leaves a
// short chunk too few items for two (32 rows at 700 keys: 2 items, 263 -> 355 us).
constexpr int64_t kTileRows = 16;
// Rows of queries a thread rounds to bf16 (or codes, int8) at least (a decode step's rows: one
// thread).
constexpr int64_t kRoundRows = 32;

template <typename T>
void run_rows(const float* q, const T* cache, int64_t block_stride, const int64_t* tables,
              int64_t table_stride, const int64_t* token_req, const int64_t* token_len,
              int64_t rows, int64_t heads, int64_t num_kv_heads, int64_t head_dim,
              int64_t block_size, int64_t window, float scale, float* out) {
  TileFn<T> fn = tile_fn<T, false>(head_dim);
  if (std::is_same_v<T, at::BFloat16> ? bf16_wide_loops() : kernel_isa(-1) >= kIsaAvx512) {
    fn = tile_fn<T, true>(head_dim);
  }
  TORCH_CHECK(fn != nullptr, "paged attention: head_dim must be 64, 128 or 256");
  const int64_t group = heads / num_kv_heads;
  // Tiles of rows, then (tile, split) items. Rows of a tile share their splits' bounds:
  // only without a window, where every row's splits start at key 0.
  std::vector<int64_t> tile_first, item_tile, item_lo, item_hi;
  std::vector<int64_t> row_first_item(rows), row_items(rows), row_slot(rows);
  for (int64_t r = 0; r < rows;) {
    int64_t n = 1;
    if (window <= 0) {
      while (n < kTileRows && r + n < rows && token_req[r + n] == token_req[r] &&
             token_len[r + n] == token_len[r + n - 1] + 1) {
        ++n;
      }
    }
    const int64_t tile = static_cast<int64_t>(tile_first.size());
    tile_first.push_back(r);
    const int64_t last_len = token_len[r + n - 1];
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, last_len - window) : 0;
    const int64_t first_item = static_cast<int64_t>(item_tile.size());
    for (int64_t lo = first_key; lo < last_len; lo += kSplitTokens) {
      item_tile.push_back(tile);
      item_lo.push_back(lo);
      item_hi.push_back(std::min(last_len, lo + kSplitTokens));
    }
    for (int64_t i = 0; i < n; ++i) {
      row_first_item[r + i] = first_item;
      row_items[r + i] = (token_len[r + i] - first_key + kSplitTokens - 1) / kSplitTokens;
      row_slot[r + i] = i;
    }
    r += n;
  }
  tile_first.push_back(rows);
  const int64_t items = static_cast<int64_t>(item_tile.size());
  // each item keeps a state for every row of its tile and every head
  std::vector<int64_t> item_state(items + 1, 0);
  for (int64_t it = 0; it < items; ++it) {
    const int64_t t = item_tile[it];
    item_state[it + 1] = item_state[it] + (tile_first[t + 1] - tile_first[t]) * heads;
  }
  // The states' sums live in the scratch arena (a 512-row chunk at 2K keys keeps 4.7 MB of
  // them); each item zeroes its own in the parallel loop below, where it then uses them.
  ScratchFrame scratch;
  float* acc = scratch.take<float>(item_state[items] * head_dim);
  State* states = scratch.take<State>(item_state[items]);
  for (int64_t s = 0; s < item_state[items]; ++s) {
    states[s] = {acc + s * head_dim, -std::numeric_limits<float>::infinity(), 0.f};
  }
  // Items differ in cost by 100x (a decode row's split vs a tile of prefill rows), so threads
  // claim them one at a time, costliest first, instead of taking fixed halves of the list;
  // which thread runs an item changes nothing in its arithmetic.
  std::vector<int64_t> order(items);
  std::vector<int64_t> cost(items);
  for (int64_t it = 0; it < items; ++it) {
    order[it] = it;
    const int64_t t = item_tile[it];
    cost[it] = (tile_first[t + 1] - tile_first[t]) * (item_hi[it] - item_lo[it]);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  if constexpr (std::is_same_v<T, at::BFloat16>) {  // scores take the query rounded to bf16
    float* rounded = scratch.take<float>(rows * heads * head_dim);
    const int64_t row = heads * head_dim;
    parallel_for(0, rows, kRoundRows, [&](int64_t begin, int64_t end) {
      round_to_bf16(q + begin * row, (end - begin) * row, rounded + begin * row);
    });
    q = rounded;
  } else if constexpr (kInt8<T>) {  // scores take each query head as int16 codes
    float* coded = scratch.take<float>(rows * heads * head_dim);
    parallel_for(0, rows, kRoundRows, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * heads; i < end * heads; ++i) {
        quantize_query(q + i * head_dim, head_dim, coded + i * head_dim);
      }
    });
    q = coded;
  }
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(items, at::get_num_threads());
  // An item's blocks: its tile's table from the item's first key to its last row's last key.
  const auto blocks = [&](int64_t it) {
    const int64_t r0 = tile_first[item_tile[it]], last = tile_first[item_tile[it] + 1] - 1;
    const int64_t hi = std::min(token_len[last], item_hi[it]);
    return ItemBlocks{tables + token_req[r0] * table_stride, item_lo[it] / block_size,
                      (hi - 1) / block_size + 1, item_lo[it] / block_size, 0};
  };
  parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    int64_t ends[kTileRows];
    const auto claim = [&] { return next.fetch_add(1, std::memory_order_relaxed); };
    // a thread claims its next item before it runs the one it has, so that the one it has
    // fetches the next one's first chunks at its end
    int64_t claimed = claim();
    ItemBlocks mine = claimed < items ? blocks(order[claimed]) : ItemBlocks{};
    while (claimed < items) {
      const int64_t it = order[claimed];
      const int64_t then = claim();
      ItemBlocks after = then < items ? blocks(order[then]) : ItemBlocks{};
      const int64_t r0 = tile_first[item_tile[it]], n = tile_first[item_tile[it] + 1] - r0;
      for (int64_t i = 0; i < n; ++i) ends[i] = std::min(token_len[r0 + i], item_hi[it]);
      std::fill(states[item_state[it]].acc, states[item_state[it + 1] - 1].acc + head_dim, 0.f);
      fn(q + r0 * heads * head_dim, heads * head_dim, cache, block_stride,
         tables + token_req[r0] * table_stride, item_lo[it], ends, n, block_size, num_kv_heads,
         group, scale, states + item_state[it], mine.next, mine.offset,
         then < items ? &after : nullptr);
      claimed = then;
      mine = after;
    }
  });
  // merge each row's splits, in order: rescale each to the common max
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t f = row_first_item[r], count = row_items[r], slot = row_slot[r];
      for (int64_t hq = 0; hq < heads; ++hq) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t it = f; it < f + count; ++it) {
          m = std::fmax(m, states[item_state[it] + slot * heads + hq].max);
        }
        float* o = out + (r * heads + hq) * head_dim;
        std::fill(o, o + head_dim, 0.f);
        float denom = 0.f;
        for (int64_t it = f; it < f + count; ++it) {
          const State& p = states[item_state[it] + slot * heads + hq];
          const float w = std::exp(p.max - m);
          denom += p.denom * w;
          for (int64_t d = 0; d < head_dim; ++d) o[d] += p.acc[d] * w;
        }
        const float inv = 1.f / denom;
        for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
      }
    }
  });
}

void check_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.stride(4) == 1 &&
                  kv_cache.stride(3) == kv_cache.size(4) &&
                  kv_cache.stride(2) == kv_cache.size(3) * kv_cache.size(4) &&
                  kv_cache.stride(1) == kv_cache.size(2) * kv_cache.stride(2),
              "kv_cache: each block's (2, block_size, num_kv_heads, head_dim) must be dense");
  TORCH_CHECK(kv_cache.size(2) <= 256, "block_size must be <= 256");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16 ||
                  kv_cache.scalar_type() == at::kChar,
              "KV cache must be fp32, bf16 or int8");
}

// q (T, H, D) float32; block_tables (B, max_blocks), token_req (T,), token_len (T,) int64
at::Tensor paged_attention_rows(const at::Tensor& q, const at::Tensor& kv_cache,
                                const at::Tensor& block_tables, const at::Tensor& token_req,
                                const at::Tensor& token_len, double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3, "q must be (T, H, D) float32");
  check_cache(kv_cache);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && token_req.scalar_type() == at::kLong &&
                  token_len.scalar_type() == at::kLong,
              "block_tables, token_req and token_len must be int64");
  TORCH_CHECK(token_req.numel() == q.size(0) && token_len.numel() == q.size(0),
              "token_req and token_len need one entry per query row");
  TORCH_CHECK(kv_head_dim(kv_cache) == q.size(2), "head_dim mismatch");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "num_heads must be a multiple of num_kv_heads");
  const at::Tensor qc = q.contiguous(), tables = block_tables.contiguous();
  const at::Tensor req = token_req.contiguous(), len = token_len.contiguous();
  at::Tensor out = at::empty_like(qc);
  paged_attention_rows_into(qc.data_ptr<float>(), kv_cache, tables.data_ptr<int64_t>(),
                            tables.size(1), req.data_ptr<int64_t>(), len.data_ptr<int64_t>(),
                            qc.size(0), qc.size(1), static_cast<float>(scale), window,
                            out.data_ptr<float>());
  return out;
}

}  // namespace

void paged_attention_rows_into(const float* q, const at::Tensor& kv_cache, const int64_t* tables,
                               int64_t table_stride, const int64_t* token_req,
                               const int64_t* token_len, int64_t rows, int64_t heads,
                               float scale, int64_t window, float* out) {
  check_cache(kv_cache);
  if (rows == 0) return;
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t head_dim = kv_head_dim(kv_cache);
  if (kv_cache.scalar_type() == at::kChar) {
    run_rows(q, kv_cache.data_ptr<int8_t>(), kv_cache.stride(0), tables, table_stride, token_req,
             token_len, rows, heads, num_kv_heads, head_dim, block_size, window, scale, out);
  } else if (kv_cache.scalar_type() == at::kBFloat16) {
    run_rows(q, kv_cache.data_ptr<at::BFloat16>(), kv_cache.stride(0), tables, table_stride,
             token_req, token_len, rows, heads, num_kv_heads, head_dim, block_size, window, scale,
             out);
  } else {
    run_rows(q, kv_cache.data_ptr<float>(), kv_cache.stride(0), tables, table_stride, token_req,
             token_len, rows, heads, num_kv_heads, head_dim, block_size, window, scale, out);
  }
}

TORCH_LIBRARY_FRAGMENT(agentx, lib) {
  lib.def(
      "paged_attention_rows(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor token_req, "
      "Tensor token_len, float scale, int window) -> Tensor");
  lib.impl("paged_attention_rows", c10::DispatchKey::CPU, &paged_attention_rows);
  // whether a bf16 cache's attention multiplies with VDPBF16PS here (benchmarks' floors)
  lib.def("attention_bf16_products() -> bool", &bf16_wide_loops);
}

}  // namespace agentx
