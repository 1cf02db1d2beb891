// One pre-norm decoder layer in one call, for decode and prefill rows alike:
//
//   h = RMSNorm(x) -> qkv = h Wqkv^T -> RoPE(q, k) -> write k, v to the paged cache
//     -> o = paged attention(q) -> x = x + o Wo^T
//   h = RMSNorm(x) -> [g | u] = h Wgu^T -> a = silu(g) * u -> x = x + a Wdown^T
//
// with every projection a packed quantized weight (qlinear.cpp) and attention the in-place
// paged kernel (paged_attention.cpp). It replaces ~20 framework ops a layer, each with its own
// dispatch and allocation, by plain loops over rows; every step is row by row, so a row's
// result does not depend on the other rows of the call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace agentx {
namespace {

// y = x / sqrt(mean(x^2) + eps) * w, per row of `dim` floats
void rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                   float* y) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * dim;
      float* yr = y + r * dim;
      float sum = 0.f;
      for (int64_t i = 0; i < dim; ++i) sum += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) yr[i] = (xr[i] * inv) * w[i];
    }
  });
}

// Neox RoPE in place on `heads` heads of `head_dim` at x (row stride ld); cos_sin rows are
// (cos[0..D/2) | sin[0..D/2)) by position.
void rope_rows(float* x, int64_t ld, int64_t rows, int64_t heads, int64_t head_dim,
               const float* cos_sin, const int64_t* positions) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* cs = cos_sin + positions[r] * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* xh = x + r * ld + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = xh[i], x2 = xh[i + half], c = cs[i], s = cs[i + half];
          xh[i] = x1 * c - x2 * s;
          xh[i + half] = x2 * c + x1 * s;
        }
      }
    }
  });
}

template <typename T>
void write_kv_rows(const float* qkv, int64_t ld, int64_t rows, int64_t k_offset,
                   int64_t kv_width, T* cache, int64_t block_stride, int64_t block_size,
                   const int64_t* slots) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t block = slots[r] / block_size, offset = slots[r] % block_size;
    T* k = cache + block * block_stride + offset * kv_width;
    T* v = k + block_size * kv_width;
    const float* src = qkv + r * ld + k_offset;
    for (int64_t i = 0; i < kv_width; ++i) {
      k[i] = static_cast<T>(src[i]);
      v[i] = static_cast<T>(src[kv_width + i]);
    }
  }
}

// exp(x), x clamped to [-87, 88]: 2^n * e^r with n = round(x / ln 2), e^r by its Taylor series
// to r^7 (relative error ~1e-7, as std::exp's within a few ulp), eight lanes at a time
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 split hi + lo
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  }
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

// a = silu(g) * u from rows [g | u] of width 2 * inter; the same arithmetic for every element
// (the tail of a row goes through a padded vector)
void silu_and_mul_rows(const float* gu, int64_t rows, int64_t inter, float* a) {
  const __m256 one = _mm256_set1_ps(1.f);
  const auto silu_mul = [&](__m256 g, __m256 u) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
  };
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gu + r * 2 * inter;
      const float* u = g + inter;
      float* ar = a + r * inter;
      int64_t i = 0;
      for (; i + 8 <= inter; i += 8) {
        _mm256_storeu_ps(ar + i, silu_mul(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
      }
      if (i < inter) {
        alignas(32) float gt[8] = {}, ut[8] = {}, at[8];
        std::memcpy(gt, g + i, sizeof(float) * (inter - i));
        std::memcpy(ut, u + i, sizeof(float) * (inter - i));
        _mm256_store_ps(at, silu_mul(_mm256_load_ps(gt), _mm256_load_ps(ut)));
        std::memcpy(ar + i, at, sizeof(float) * (inter - i));
      }
    }
  });
}

void add_rows(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

// Opt-in stage timings (benchmarks/step_profile.py): nanoseconds per stage, summed over calls.
enum Stage { kNorms, kGemms, kRopeWriteKv, kAttention, kElementwise, kStages };
std::atomic<bool> g_profiling{false};
std::atomic<int64_t> g_stage_ns[kStages];

struct StageClock {
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
  void lap(Stage stage) {
    if (!g_profiling.load(std::memory_order_relaxed)) return;
    const auto now = std::chrono::steady_clock::now();
    g_stage_ns[stage] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count();
    last = now;
  }
};

// [norms, GEMMs, RoPE + KV write, attention, elementwise] ns since the last read; on: keep timing
at::Tensor layer_stage_times(bool on) {
  g_profiling = on;
  at::Tensor out = at::empty({kStages}, at::TensorOptions().dtype(at::kLong));
  for (int i = 0; i < kStages; ++i) out.data_ptr<int64_t>()[i] = g_stage_ns[i].exchange(0);
  return out;
}

struct Linear {
  const at::Tensor& w;
  const at::Tensor& scale;
  const at::Tensor& mins;
  int64_t bits;
  int64_t out() const { return is_kquant(bits) ? w.size(0) : w.size(0) * 8; }  // K-quant: rows
};

// weights: [norm1, qkv (w, scale, mins), o (3), norm2, gate_up (3), down (3)];
// bits: [qkv, o, gate_up, down]
at::Tensor fused_decoder_layer(const at::Tensor& x, const at::Tensor& positions,
                               const at::Tensor& cos_sin, at::TensorList weights,
                               at::IntArrayRef bits, const at::Tensor& kv_cache,
                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& token_req, const at::Tensor& token_len,
                               int64_t num_heads, double eps, double scale, int64_t window) {
  TORCH_CHECK(weights.size() == 14 && bits.size() == 4, "fused_decoder_layer: 14 weights, 4 bits");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be contiguous (T, hidden) float32");
  for (const auto* t : {&positions, &slot_mapping, &block_tables, &token_req, &token_len}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors: int64");
  }
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous(), "cos_sin: fp32");
  const int64_t rows = x.size(0), hidden = x.size(1);
  const int64_t num_kv_heads = kv_cache.size(3), head_dim = kv_head_dim(kv_cache);
  TORCH_CHECK(cos_sin.size(1) == head_dim, "RoPE table must cover the whole head");
  const Linear qkv{weights[1], weights[2], weights[3], bits[0]};
  const Linear o_proj{weights[4], weights[5], weights[6], bits[1]};
  const Linear gate_up{weights[8], weights[9], weights[10], bits[2]};
  const Linear down{weights[11], weights[12], weights[13], bits[3]};
  const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  const int64_t qkv_width = qkv.out(), inter = gate_up.out() / 2;
  TORCH_CHECK(qkv_width == q_width + 2 * kv_width, "qkv_proj width mismatch");
  TORCH_CHECK(o_proj.out() == hidden && down.out() == hidden, "output width mismatch");
  TORCH_CHECK(positions.numel() == rows && slot_mapping.numel() == rows,
              "positions and slot_mapping need one entry per row");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos_sin.size(0), "position ", pos[r],
                " is outside the RoPE table of ", cos_sin.size(0), " positions");
  }
  at::Tensor out = x.clone();
  if (rows == 0) return out;
  float* xo = out.data_ptr<float>();
  std::vector<float> h(rows * hidden), buf(rows * std::max(qkv_width, 2 * inter));
  std::vector<float> q(rows * q_width), attn(rows * q_width), y(rows * hidden);
  std::vector<float> act(rows * inter);
  const float feps = static_cast<float>(eps);
  StageClock clock;
  // attention half
  rms_norm_rows(xo, weights[0].data_ptr<float>(), rows, hidden, feps, h.data());
  clock.lap(kNorms);
  quantized_linear_into(h.data(), rows, hidden, qkv.w, qkv.scale, qkv.mins, qkv.bits,
                        buf.data(), qkv_width);
  clock.lap(kGemms);
  rope_rows(buf.data(), qkv_width, rows, num_heads + num_kv_heads, head_dim,
            cos_sin.data_ptr<float>(), pos);
  if (kv_cache.scalar_type() == at::kChar) {
    write_kv_rows_int8(buf.data() + q_width, buf.data() + q_width + kv_width, qkv_width, rows,
                       num_kv_heads, head_dim, kv_cache.data_ptr<int8_t>(), kv_cache.stride(0),
                       kv_cache.size(2), slot_mapping.data_ptr<int64_t>());
  } else if (kv_cache.scalar_type() == at::kBFloat16) {
    write_kv_rows(buf.data(), qkv_width, rows, q_width, kv_width,
                  kv_cache.data_ptr<at::BFloat16>(), kv_cache.stride(0), kv_cache.size(2),
                  slot_mapping.data_ptr<int64_t>());
  } else {
    write_kv_rows(buf.data(), qkv_width, rows, q_width, kv_width, kv_cache.data_ptr<float>(),
                  kv_cache.stride(0), kv_cache.size(2), slot_mapping.data_ptr<int64_t>());
  }
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(q.data() + r * q_width, buf.data() + r * qkv_width, sizeof(float) * q_width);
  }
  clock.lap(kRopeWriteKv);
  paged_attention_rows_into(q.data(), kv_cache, block_tables.data_ptr<int64_t>(),
                            block_tables.size(1), token_req.data_ptr<int64_t>(),
                            token_len.data_ptr<int64_t>(), rows, num_heads,
                            static_cast<float>(scale), window, attn.data());
  clock.lap(kAttention);
  quantized_linear_into(attn.data(), rows, q_width, o_proj.w, o_proj.scale, o_proj.mins,
                        o_proj.bits, y.data(), hidden);
  clock.lap(kGemms);
  add_rows(xo, y.data(), rows * hidden);
  clock.lap(kElementwise);
  // MLP half
  rms_norm_rows(xo, weights[7].data_ptr<float>(), rows, hidden, feps, h.data());
  clock.lap(kNorms);
  quantized_linear_into(h.data(), rows, hidden, gate_up.w, gate_up.scale, gate_up.mins,
                        gate_up.bits, buf.data(), 2 * inter);
  clock.lap(kGemms);
  silu_and_mul_rows(buf.data(), rows, inter, act.data());
  clock.lap(kElementwise);
  quantized_linear_into(act.data(), rows, inter, down.w, down.scale, down.mins, down.bits,
                        y.data(), hidden);
  clock.lap(kGemms);
  add_rows(xo, y.data(), rows * hidden);
  clock.lap(kElementwise);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(agentx, lib) {
  lib.def(
      "fused_decoder_layer(Tensor x, Tensor positions, Tensor cos_sin, Tensor[] weights, "
      "int[] bits, Tensor kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor token_req, "
      "Tensor token_len, int num_heads, float eps, float scale, int window) -> Tensor");
  lib.impl("fused_decoder_layer", c10::DispatchKey::CPU, &fused_decoder_layer);
  lib.def("layer_stage_times(bool on) -> Tensor", &layer_stage_times);
}

}  // namespace agentx
