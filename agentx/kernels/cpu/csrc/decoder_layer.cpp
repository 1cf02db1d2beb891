// One pre-norm decoder layer in one call, for decode and prefill rows alike:
//
//   h = RMSNorm(x) -> qkv = h Wqkv^T (+ b) -> RoPE(q, k) -> write k, v to the paged cache
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
#include <string>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "qlinear_common.h"
#include "scratch.h"

namespace agentx {
namespace {

// Rows the MLP half runs at a time: a 2K-token prefill chunk's gate/up rows (2048 x 17,920
// floats on Qwen2.5-Coder-1.5B: 147 MB) would go to DRAM and back; 256 rows' stay in cache.
constexpr int64_t kMlpRows = 256;

// y = x / sqrt(mean(x^2) + eps) * w, per row of `dim` floats. A row's sum of squares is one
// chain of adds, i = 0, 1, ..., each square rounded first (never fused into an FMA: the empty
// asm keeps the product apart); kNormRows rows run their chains side by side, since a chain
// waits on its previous add every step (40 rows of 576: 20 -> 6 us, on one thread below 64
// rows, 60 norms a step). Where `dim` is a multiple of 8 (every model's hidden size) these are
// the bits of the earlier one-row loop, which GCC vectorized as products, then the adds.
constexpr int64_t kNormRows = 8;

inline float square(float v) {
  float s = v * v;
  asm("" : "+x"(s));
  return s;
}

inline void scale_row(const float* xr, const float* w, int64_t dim, float sum, float eps,
                      float* yr) {
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) yr[i] = (xr[i] * inv) * w[i];
}

void rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                   float* y) {
  parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    int64_t r = begin;
    for (; r + kNormRows <= end; r += kNormRows) {
      float sum[kNormRows] = {};
      for (int64_t i = 0; i < dim; ++i) {
        for (int64_t k = 0; k < kNormRows; ++k) sum[k] += square(x[(r + k) * dim + i]);
      }
      for (int64_t k = 0; k < kNormRows; ++k) {
        scale_row(x + (r + k) * dim, w, dim, sum[k], eps, y + (r + k) * dim);
      }
    }
    for (; r < end; ++r) {
      const float* xr = x + r * dim;
      float sum = 0.f;
      for (int64_t i = 0; i < dim; ++i) sum += square(xr[i]);
      scale_row(xr, w, dim, sum, eps, y + r * dim);
    }
  });
}

// Neox RoPE in place on `heads` heads of `head_dim` at x (row stride ld); cos_sin rows are
// (cos[0..D/2) | sin[0..D/2)) by position.
void rope_rows(float* x, int64_t ld, int64_t rows, int64_t heads, int64_t head_dim,
               const float* cos_sin, const int64_t* positions) {
  const int64_t half = head_dim / 2;
  parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
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
  parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {  // every row its own slot
    for (int64_t r = begin; r < end; ++r) {
      const int64_t block = slots[r] / block_size, offset = slots[r] % block_size;
      T* k = cache + block * block_stride + offset * kv_width;
      T* v = k + block_size * kv_width;
      const float* src = qkv + r * ld + k_offset;
      for (int64_t i = 0; i < kv_width; ++i) {
        k[i] = static_cast<T>(src[i]);
        v[i] = static_cast<T>(src[kv_width + i]);
      }
    }
  });
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
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
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

// The residual add of `rows` rows of `width`: on the team from 64 rows (a 512-row chunk's
// 1.2 MB took ~0.1 ms on the engine thread, twice a layer, the other thread waiting)
void add_residual(float* x, const float* y, int64_t rows, int64_t width) {
  parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    add_rows(x + begin * width, y + begin * width, (end - begin) * width);
  });
}

// y[r] += b for `rows` rows of b's width, ld floats apart: one fp32 add an element after the
// matmul, as kquant_linear's y.add_(bias) (the unfused layer's arithmetic)
void add_bias_rows(float* y, int64_t ld, int64_t rows, const float* b, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) add_rows(y + r * ld, b, width);
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

// The layer's weights, named. The op takes them as `Tensor[] weights, int[] bits` in the order
// layer_fields() walks them, which is the order of FusedLayerWeights' fields on the Python side
// (kernels/cpu/fused_layer.py; a test compares the two through fused_layer_fields()):
//
//   weights  input_norm | qkv_proj (qweight, scale, mins) | qkv_proj_1 (3) | qkv_proj_2 (3)
//            | qkv_bias | o_proj (3) | post_attention_norm | gate_up_proj (3) | down_proj (3)
//   bits     qkv_proj | qkv_proj_1 | qkv_proj_2 | o_proj | gate_up_proj | down_proj
//            (4, 8, or a K-quant type id; 0 for an absent run)
//
// q | k | v is qkv_proj's columns, then each present run's (K-quant only), then + qkv_bias
// (empty: none):   | qkv_proj | qkv_proj_1 | qkv_proj_2 |
struct QuantLinear {
  const at::Tensor& qweight;
  const at::Tensor& scale;  // K-quant: unused
  const at::Tensor& mins;   // K-quant and int8: unused
  int64_t bits;
  int64_t out_features() const {
    return is_kquant(bits) ? qweight.size(0) : qweight.size(0) * qlinear::kTile;
  }
};

struct LayerWeights {
  const at::Tensor& input_norm;
  QuantLinear qkv_proj;
  QuantLinear qkv_proj_1;  // bits 0: absent
  QuantLinear qkv_proj_2;
  const at::Tensor& qkv_bias;  // (qkv width,) or empty
  QuantLinear o_proj;
  const at::Tensor& post_attention_norm;
  QuantLinear gate_up_proj;
  QuantLinear down_proj;
};

// The one list of the layer's fields, in packing order: every reader of the layout (the
// unpacking, the counts, the names) walks this, so none can disagree with it. Braced
// initializers run left to right, so `fields` sees them in order.
template <typename Fields>
LayerWeights layer_fields(Fields& fields) {
  return LayerWeights{fields.norm("input_norm"),       fields.linear("qkv_proj"),
                      fields.run("qkv_proj_1"),        fields.run("qkv_proj_2"),
                      fields.bias("qkv_bias"),         fields.linear("o_proj"),
                      fields.norm("post_attention_norm"), fields.linear("gate_up_proj"),
                      fields.linear("down_proj")};
}

const at::Tensor& no_tensor() {
  static const at::Tensor none;
  return none;
}

// Counts the fields and names them ("qkv_proj.qweight", ..., "qkv_proj.bits").
struct FieldNames {
  std::vector<std::string> names;
  int64_t tensors = 0, linears = 0;
  const at::Tensor& norm(const char* name) {
    names.emplace_back(name);
    ++tensors;
    return no_tensor();
  }
  const at::Tensor& bias(const char* name) { return norm(name); }
  QuantLinear linear(const char* name) {
    for (const char* part : {".qweight", ".scale", ".mins", ".bits"}) {
      names.push_back(std::string(name) + part);
    }
    tensors += 3;
    ++linears;
    return QuantLinear{no_tensor(), no_tensor(), no_tensor(), 0};
  }
  QuantLinear run(const char* name) { return linear(name); }
};

const FieldNames& field_names() {
  static const FieldNames names = [] {
    FieldNames n;
    layer_fields(n);
    return n;
  }();
  return names;
}

// Takes the fields from the op's lists in order, checking each against what the kernels read.
struct Unpack {
  at::TensorList weights;
  at::IntArrayRef bits;
  int64_t hidden;
  size_t t = 0, b = 0;

  const at::Tensor& norm(const char* name) {
    const at::Tensor& w = weights[t++];
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == hidden &&
                    w.is_contiguous(),
                "fused_decoder_layer: ", name, " must be a contiguous float32 (", hidden,
                ",) tensor, got ", w.scalar_type(), " ", w.sizes());
    return w;
  }

  QuantLinear linear(const char* name) {
    const QuantLinear lin{weights[t], weights[t + 1], weights[t + 2], bits[b]};
    t += 3;
    ++b;
    const int64_t kind = lin.bits;
    TORCH_CHECK(kind == 4 || kind == 8 || is_kquant(kind), "fused_decoder_layer: ", name,
                ".bits must be 4, 8, ", kQ4K, " (Q4_K) or ", kQ6K, " (Q6_K), got ", kind);
    const auto want = kind == 8 ? at::kChar : at::kByte;
    const int64_t dims = is_kquant(kind) ? 2 : 3;
    TORCH_CHECK(lin.qweight.scalar_type() == want && lin.qweight.dim() == dims,
                "fused_decoder_layer: ", name, ".qweight must be ", dims, "-D ",
                kind == 8 ? "int8" : "uint8", " for bits ", kind, ", got ",
                lin.qweight.scalar_type(), " ", lin.qweight.sizes());
    if (!is_kquant(kind)) {
      TORCH_CHECK(lin.scale.scalar_type() == at::kFloat, "fused_decoder_layer: ", name,
                  ".scale must be float32, got ", lin.scale.scalar_type());
      TORCH_CHECK(kind == 8 || lin.mins.scalar_type() == at::kFloat, "fused_decoder_layer: ",
                  name, ".mins must be float32, got ", lin.mins.scalar_type());
    }
    return lin;
  }

  // A further run of a projection's columns: absent (bits 0) or a K-quant weight.
  QuantLinear run(const char* name) {
    if (bits[b] == 0) {
      const QuantLinear absent{weights[t], weights[t + 1], weights[t + 2], 0};
      t += 3;
      ++b;
      return absent;
    }
    TORCH_CHECK(is_kquant(bits[b]), "fused_decoder_layer: ", name, ".bits must be 0 (absent), ",
                kQ4K, " (Q4_K) or ", kQ6K, " (Q6_K), got ", bits[b]);
    return linear(name);
  }

  // float32 (width,) added after a projection, or empty; its width is checked by the caller
  const at::Tensor& bias(const char* name) {
    const at::Tensor& w = weights[t++];
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 1 && w.is_contiguous(),
                "fused_decoder_layer: ", name, " must be a contiguous 1-D float32 tensor, got ",
                w.scalar_type(), " ", w.sizes());
    return w;
  }
};

LayerWeights unpack_layer_weights(at::TensorList weights, at::IntArrayRef bits, int64_t hidden) {
  const FieldNames& fields = field_names();
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == fields.tensors &&
                  static_cast<int64_t>(bits.size()) == fields.linears,
              "fused_decoder_layer: ", fields.tensors, " weights and ", fields.linears,
              " bits expected (see FusedLayerWeights), got ", weights.size(), " and ",
              bits.size());
  Unpack unpack{weights, bits, hidden};
  return layer_fields(unpack);
}

// The field names in packing order (tests compare them with FusedLayerWeights').
std::vector<std::string> fused_layer_fields() { return field_names().names; }

at::Tensor fused_decoder_layer(const at::Tensor& x, const at::Tensor& positions,
                               const at::Tensor& cos_sin, at::TensorList weights,
                               at::IntArrayRef bits, const at::Tensor& kv_cache,
                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& token_req, const at::Tensor& token_len,
                               int64_t num_heads, double eps, double scale, int64_t window,
                               const c10::optional<at::Tensor>& keep) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be contiguous (T, hidden) float32");
  for (const auto* t : {&positions, &slot_mapping, &block_tables, &token_req, &token_len}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors: int64");
  }
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous(), "cos_sin: fp32");
  const int64_t rows = x.size(0), hidden = x.size(1);
  const LayerWeights w = unpack_layer_weights(weights, bits, hidden);
  const QuantLinear &o_proj = w.o_proj, &gate_up = w.gate_up_proj, &down = w.down_proj;
  const QuantLinear* qkv_runs[] = {&w.qkv_proj, &w.qkv_proj_1, &w.qkv_proj_2};
  const int64_t num_kv_heads = kv_cache.size(3), head_dim = kv_head_dim(kv_cache);
  TORCH_CHECK(cos_sin.size(1) == head_dim, "RoPE table must cover the whole head");
  const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  int64_t qkv_width = 0;
  for (const QuantLinear* run : qkv_runs) qkv_width += run->bits ? run->out_features() : 0;
  const int64_t inter = gate_up.out_features() / 2;
  TORCH_CHECK(qkv_width == q_width + 2 * kv_width, "qkv_proj width mismatch: its runs give ",
              qkv_width, " columns, the heads need ", q_width + 2 * kv_width);
  const int64_t bias_width = w.qkv_bias.numel();
  TORCH_CHECK(bias_width == 0 || bias_width == qkv_width, "fused_decoder_layer: qkv_bias must be ",
              "empty or (", qkv_width, ",), got (", bias_width, ",)");
  TORCH_CHECK(o_proj.out_features() == hidden && down.out_features() == hidden,
              "output width mismatch");
  TORCH_CHECK(positions.numel() == rows && slot_mapping.numel() == rows,
              "positions and slot_mapping need one entry per row");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos_sin.size(0), "position ", pos[r],
                " is outside the RoPE table of ", cos_sin.size(0), " positions");
  }
  // keep: the rows whose outputs the caller reads, ascending (the last layer's sampled rows).
  // Every row's K and V are written; attention, o_proj and the MLP run for the kept rows
  // alone, each of which comes out as it would among all (a row's result is its own).
  const bool some = keep.has_value() && keep->defined();
  const int64_t* kept = nullptr;
  int64_t out_rows = rows;
  if (some) {
    TORCH_CHECK(keep->scalar_type() == at::kLong && keep->dim() == 1 && keep->is_contiguous(),
                "fused_decoder_layer: keep must be a contiguous 1-D int64 tensor");
    kept = keep->data_ptr<int64_t>();
    out_rows = keep->numel();
    for (int64_t i = 0; i < out_rows; ++i) {
      TORCH_CHECK(kept[i] >= 0 && kept[i] < rows && (i == 0 || kept[i] > kept[i - 1]),
                  "fused_decoder_layer: keep must list rows of x in ascending order, once each");
    }
  }
  at::Tensor out = some ? x.index_select(0, *keep) : x.clone();
  if (rows == 0) return out;
  float* xo = out.data_ptr<float>();
  ScratchFrame scratch;
  float* h = scratch.take<float>(rows * hidden);
  const int64_t mlp_rows = std::min(rows, kMlpRows);
  float* buf = scratch.take<float>(std::max(rows * qkv_width, mlp_rows * 2 * inter));
  float* q = scratch.take<float>(rows * q_width);
  float* attn = scratch.take<float>(rows * q_width);
  float* y = scratch.take<float>(rows * hidden);
  float* act = scratch.take<float>(mlp_rows * inter);
  const float feps = static_cast<float>(eps);
  StageClock clock;
  // attention half
  rms_norm_rows(x.data_ptr<float>(), w.input_norm.data_ptr<float>(), rows, hidden, feps, h);
  clock.lap(kNorms);
  int64_t column = 0;
  for (const QuantLinear* run : qkv_runs) {
    if (!run->bits) continue;
    quantized_linear_into(h, rows, hidden, run->qweight, run->scale, run->mins, run->bits,
                          buf + column, qkv_width);
    column += run->out_features();
  }
  clock.lap(kGemms);
  if (bias_width) {
    add_bias_rows(buf, qkv_width, rows, w.qkv_bias.data_ptr<float>(), qkv_width);
    clock.lap(kElementwise);
  }
  rope_rows(buf, qkv_width, rows, num_heads + num_kv_heads, head_dim,
            cos_sin.data_ptr<float>(), pos);
  if (kv_cache.scalar_type() == at::kChar) {
    write_kv_rows_int8(buf + q_width, buf + q_width + kv_width, qkv_width, rows, num_kv_heads,
                       head_dim, kv_cache.data_ptr<int8_t>(), kv_cache.stride(0),
                       kv_cache.size(2), slot_mapping.data_ptr<int64_t>());
  } else if (kv_cache.scalar_type() == at::kBFloat16) {
    write_kv_rows(buf, qkv_width, rows, q_width, kv_width,
                  kv_cache.data_ptr<at::BFloat16>(), kv_cache.stride(0), kv_cache.size(2),
                  slot_mapping.data_ptr<int64_t>());
  } else {
    write_kv_rows(buf, qkv_width, rows, q_width, kv_width, kv_cache.data_ptr<float>(),
                  kv_cache.stride(0), kv_cache.size(2), slot_mapping.data_ptr<int64_t>());
  }
  const int64_t* req = token_req.data_ptr<int64_t>();
  const int64_t* len = token_len.data_ptr<int64_t>();
  if (some) {
    int64_t* kept_req = scratch.take<int64_t>(out_rows);
    int64_t* kept_len = scratch.take<int64_t>(out_rows);
    for (int64_t i = 0; i < out_rows; ++i) {
      kept_req[i] = req[kept[i]];
      kept_len[i] = len[kept[i]];
    }
    req = kept_req;
    len = kept_len;
  }
  for (int64_t r = 0; r < out_rows; ++r) {
    const int64_t from = some ? kept[r] : r;
    std::memcpy(q + r * q_width, buf + from * qkv_width, sizeof(float) * q_width);
  }
  clock.lap(kRopeWriteKv);
  paged_attention_rows_into(q, kv_cache, block_tables.data_ptr<int64_t>(),
                            block_tables.size(1), req, len, out_rows, num_heads,
                            static_cast<float>(scale), window, attn);
  clock.lap(kAttention);
  quantized_linear_into(attn, out_rows, q_width, o_proj.qweight, o_proj.scale, o_proj.mins,
                        o_proj.bits, y, hidden);
  clock.lap(kGemms);
  add_residual(xo, y, out_rows, hidden);
  clock.lap(kElementwise);
  // MLP half, kMlpRows rows at a time (every row's result is its own, so the same bits)
  for (int64_t r0 = 0; r0 < out_rows; r0 += kMlpRows) {
    const int64_t n = std::min(kMlpRows, out_rows - r0);
    float* xr = xo + r0 * hidden;
    rms_norm_rows(xr, w.post_attention_norm.data_ptr<float>(), n, hidden, feps, h);
    clock.lap(kNorms);
    quantized_linear_into(h, n, hidden, gate_up.qweight, gate_up.scale, gate_up.mins,
                          gate_up.bits, buf, 2 * inter);
    clock.lap(kGemms);
    silu_and_mul_rows(buf, n, inter, act);
    clock.lap(kElementwise);
    quantized_linear_into(act, n, inter, down.qweight, down.scale, down.mins, down.bits, y,
                          hidden);
    clock.lap(kGemms);
    add_residual(xr, y, n, hidden);
    clock.lap(kElementwise);
  }
  return out;
}

// Consecutive layers that share everything but their weights and KV caches, in one call: layer
// l takes weights[l * F, (l + 1) * F) and bits[l * B, (l + 1) * B) (F, B: one layer's lists) and
// kv_caches[l]; the last takes `keep`. Each is fused_decoder_layer's call, so the same bits;
// what goes is the framework's work between the calls (a dispatch, its argument lists and the
// model's Python around each layer: 0.7-3 ms a step of SmolLM2's 30 layers, step_profile.py).
at::Tensor fused_decoder_layers(const at::Tensor& x, const at::Tensor& positions,
                                const at::Tensor& cos_sin, at::TensorList weights,
                                at::IntArrayRef bits, at::TensorList kv_caches,
                                const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                const at::Tensor& token_req, const at::Tensor& token_len,
                                int64_t num_heads, double eps, double scale, int64_t window,
                                const c10::optional<at::Tensor>& keep) {
  const FieldNames& fields = field_names();
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == layers * fields.tensors &&
                  static_cast<int64_t>(bits.size()) == layers * fields.linears,
              "fused_decoder_layers: ", fields.tensors, " weights and ", fields.linears,
              " bits a KV cache expected, got ", weights.size(), " and ", bits.size(), " for ",
              layers, " KV caches");
  at::Tensor h = x;
  for (int64_t l = 0; l < layers; ++l) {
    const at::TensorList layer_weights = weights.slice(l * fields.tensors, fields.tensors);
    const at::IntArrayRef layer_bits = bits.slice(l * fields.linears, fields.linears);
    h = fused_decoder_layer(h, positions, cos_sin, layer_weights, layer_bits, kv_caches[l],
                            slot_mapping, block_tables, token_req, token_len, num_heads, eps,
                            scale, window, l + 1 == layers ? keep : c10::nullopt);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(agentx, lib) {
  lib.def(
      "fused_decoder_layer(Tensor x, Tensor positions, Tensor cos_sin, Tensor[] weights, "
      "int[] bits, Tensor kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor token_req, "
      "Tensor token_len, int num_heads, float eps, float scale, int window, Tensor? keep=None) "
      "-> Tensor");
  lib.impl("fused_decoder_layer", c10::DispatchKey::CPU, &fused_decoder_layer);
  lib.def(
      "fused_decoder_layers(Tensor x, Tensor positions, Tensor cos_sin, Tensor[] weights, "
      "int[] bits, Tensor[] kv_caches, Tensor slot_mapping, Tensor block_tables, "
      "Tensor token_req, Tensor token_len, int num_heads, float eps, float scale, int window, "
      "Tensor? keep=None) -> Tensor");
  lib.impl("fused_decoder_layers", c10::DispatchKey::CPU, &fused_decoder_layers);
  lib.def("layer_stage_times(bool on) -> Tensor", &layer_stage_times);
  lib.def("fused_layer_fields() -> str[]", &fused_layer_fields);
}

}  // namespace agentx
