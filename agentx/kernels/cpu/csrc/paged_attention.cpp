// Decode attention over the paged KV cache, read in place through the block table.
//
// KV cache of one layer: (num_blocks, 2, block_size, num_kv_heads, head_dim), float32 or
// bfloat16. One query token per request, at position seq_len - 1; with a sliding window W it
// sees keys seq_len - W .. seq_len - 1 only (blocks before that may already be freed and are
// never read). Query head h reads KV head h / (num_heads / num_kv_heads). Softmax runs online
// over blocks in float32; a long context is cut into splits of kSplitTokens keys that run as
// separate tasks (every KV head of one split a task) and merge by their max and denominator.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace agentx {
namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Partial softmax state of one query head over a range of keys: max score, sum of
// exp(score - max) and the exp-weighted sum of values; partials of one head merge exactly.
struct Partial {
  float max;
  float denom;
};

template <typename T, int D>
inline float dot(const float* q, const T* k) {
  __m256 acc = _mm256_setzero_ps();
  for (int i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(load8(q + i), load8(k + i), acc);
  return hsum(acc);
}

// [sum(a[0]), ..., sum(a[7])]: eight horizontal sums in one register.
inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scores of 8 consecutive keys (token_stride apart) against q.
template <typename T, int D>
inline __m256 dot8(const float* q, const T* k, int64_t token_stride) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int i = 0; i < D; i += 8) {
    const __m256 qv = load8(q + i);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(k + j * token_stride + i), acc[j]);
  }
  return hsum8(acc);
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

// Keys [lo, hi) of one request and KV head, for the `group` query heads that read it.
template <typename T, int D>
void attend_range(const float* q, const T* cache, int64_t block_stride, const int64_t* table,
                  int64_t lo, int64_t hi, int64_t block_size, int64_t token_stride,
                  int64_t kv_head, int64_t group, float scale, float* acc, Partial* part) {
  constexpr int kMaxBlock = 256;
  alignas(32) float score[kMaxBlock + 8];
  const __m256 scale_v = _mm256_set1_ps(scale);
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * D;
    float* ag = acc + g * D;
    __m256 av[D / 8];
    for (int i = 0; i < D / 8; ++i) av[i] = _mm256_setzero_ps();
    float running_max = -std::numeric_limits<float>::infinity(), denom = 0.f;
    for (int64_t start = lo; start < hi;) {
      const int64_t b = start / block_size;
      const int64_t end = std::min(hi, (b + 1) * block_size);
      const int64_t count = end - start;
      const T* kb = cache + table[b] * block_stride + kv_head * D + (start - b * block_size) * token_stride;
      const T* vb = kb + block_size * token_stride;
      int64_t t = 0;
      for (; t + 8 <= count; t += 8) {
        _mm256_store_ps(score + t, _mm256_mul_ps(dot8<T, D>(qg, kb + t * token_stride, token_stride), scale_v));
      }
      for (; t < count; ++t) score[t] = dot<T, D>(qg, kb + t * token_stride) * scale;
      float block_max = -std::numeric_limits<float>::infinity();
      for (t = 0; t < count; ++t) block_max = std::fmax(block_max, score[t]);
      const float new_max = std::fmax(running_max, block_max);
      const float correction = std::exp(running_max - new_max);
      denom *= correction;
      const __m256 cv = _mm256_set1_ps(correction);
      for (int i = 0; i < D / 8; ++i) av[i] = _mm256_mul_ps(av[i], cv);
      const __m256 max_v = _mm256_set1_ps(new_max);
      for (t = 0; t < count; t += 8) {
        _mm256_store_ps(score + t, exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(score + t), max_v)));
      }
      for (t = 0; t < count; ++t) {
        denom += score[t];
        const __m256 pv = _mm256_set1_ps(score[t]);
        const T* v = vb + t * token_stride;
        for (int i = 0; i < D / 8; ++i) av[i] = _mm256_fmadd_ps(pv, load8(v + 8 * i), av[i]);
      }
      running_max = new_max;
      start = end;
    }
    for (int i = 0; i < D / 8; ++i) _mm256_storeu_ps(ag + 8 * i, av[i]);
    part[g] = {running_max, denom};
  }
}

template <typename T>
using RangeFn = void (*)(const float*, const T*, int64_t, const int64_t*, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int64_t, float, float*, Partial*);

template <typename T>
RangeFn<T> range_fn(int64_t head_dim) {
  switch (head_dim) {
    case 64: return &attend_range<T, 64>;
    case 128: return &attend_range<T, 128>;
    case 256: return &attend_range<T, 256>;
    default: return nullptr;
  }
}

// Keys a split: long contexts are cut so that a few requests still keep every thread busy.
constexpr int64_t kSplitTokens = 512;

template <typename T>
void run_decode(const float* qp, const T* cache, int64_t block_stride, const int64_t* tp,
                int64_t stride_table, const int64_t* lp, int64_t batch, int64_t heads,
                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
                float scale, float* op) {
  const RangeFn<T> fn = range_fn<T>(head_dim);
  TORCH_CHECK(fn != nullptr, "paged decode attention: head_dim must be 64, 128 or 256");
  const int64_t group = heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
  // (request, split) work items; each runs every KV head of its split
  std::vector<int64_t> item_req, item_lo, item_hi, first_item(batch + 1, 0);
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t first = window > 0 ? std::max<int64_t>(0, lp[i] - window) : 0;
    for (int64_t lo = first; lo < lp[i]; lo += kSplitTokens) {
      item_req.push_back(i);
      item_lo.push_back(lo);
      item_hi.push_back(std::min(lp[i], lo + kSplitTokens));
    }
    first_item[i + 1] = static_cast<int64_t>(item_req.size());
  }
  const int64_t items = static_cast<int64_t>(item_req.size());
  std::vector<float> acc(items * heads * head_dim);
  std::vector<Partial> parts(items * heads);
  at::parallel_for(0, items * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t item = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t i = item_req[item], head0 = h * group;
      fn(qp + (i * heads + head0) * head_dim, cache, block_stride, tp + i * stride_table,
         item_lo[item], item_hi[item], block_size, token_stride, h, group, scale,
         acc.data() + (item * heads + head0) * head_dim, parts.data() + item * heads + head0);
    }
  });
  // merge the splits of each request and head: rescale each to the common max
  for (int64_t i = 0; i < batch; ++i) {
    for (int64_t hq = 0; hq < heads; ++hq) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t it = first_item[i]; it < first_item[i + 1]; ++it) {
        m = std::fmax(m, parts[it * heads + hq].max);
      }
      float* out = op + (i * heads + hq) * head_dim;
      std::fill(out, out + head_dim, 0.f);
      float denom = 0.f;
      for (int64_t it = first_item[i]; it < first_item[i + 1]; ++it) {
        const Partial& p = parts[it * heads + hq];
        const float w = std::exp(p.max - m);
        denom += p.denom * w;
        const float* a = acc.data() + (it * heads + hq) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) out[d] += a[d] * w;
      }
      const float inv = 1.f / denom;
      for (int64_t d = 0; d < head_dim; ++d) out[d] *= inv;
    }
  }
}

// q (B, H, D) float32; block_tables (B, max_blocks) int64; seq_lens (B,) int64 -> (B, H, D)
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3, "q must be (B, H, D) float32");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.stride(4) == 1 &&
                  kv_cache.stride(3) == kv_cache.size(4) &&
                  kv_cache.stride(2) == kv_cache.size(3) * kv_cache.size(4) &&
                  kv_cache.stride(1) == kv_cache.size(2) * kv_cache.stride(2),
              "kv_cache: each block's (2, block_size, num_kv_heads, head_dim) must be dense");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(kv_cache.size(2) <= 256, "block_size must be <= 256");
  const at::Tensor qc = q.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const int64_t batch = qc.size(0), heads = qc.size(1), head_dim = qc.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_dim, "head_dim mismatch");
  TORCH_CHECK(heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  at::Tensor out = at::empty_like(qc);
  const float fscale = static_cast<float>(scale);
  if (kv_cache.scalar_type() == at::kBFloat16) {
    run_decode(qc.data_ptr<float>(), kv_cache.data_ptr<at::BFloat16>(), kv_cache.stride(0),
               tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(), batch,
               heads, num_kv_heads, head_dim, block_size, window, fscale, out.data_ptr<float>());
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kFloat, "KV cache must be fp32 or bf16");
    run_decode(qc.data_ptr<float>(), kv_cache.data_ptr<float>(), kv_cache.stride(0),
               tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(), batch,
               heads, num_kv_heads, head_dim, block_size, window, fscale, out.data_ptr<float>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(agentx, lib) {
  lib.def(
      "paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int window) -> Tensor");
  lib.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}

}  // namespace agentx
