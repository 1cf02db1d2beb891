// Greedy sampling's argmax over each row of a (rows, vocab) float32 logits tensor: the index
// torch.argmax gives (the first maximum; the first NaN where a row has one), read at memory
// speed on the kernels' team. torch's reduction keeps an index beside every compare, about
// 1.2 G logits a second a thread: 1.6 ms for 40 rows of SmolLM2's 49,152 on one thread (a
// saturated step samples 20-40 rows).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "parallel.h"

namespace agentx {
namespace {

// The first index of the row's maximum, or of its first NaN (n > 0).
int64_t argmax_row(const float* x, int64_t n) {
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top = _mm256_max_ps(top, v);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  float best = lanes[0];
  for (int k = 1; k < 8; ++k) best = lanes[k] > best ? lanes[k] : best;
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < n; ++j) {
    has_nan = has_nan || std::isnan(x[j]);
    best = x[j] > best ? x[j] : best;
  }
  if (has_nan) {
    for (int64_t j = 0; j < n; ++j) {
      if (std::isnan(x[j])) return j;
    }
  }
  // the first element equal to the maximum (-0 equals +0: the first of either, as torch)
  const __m256 want = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= n; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), want, _CMP_EQ_OQ));
    if (mask != 0) return i + __builtin_ctz(static_cast<unsigned>(mask));
  }
  for (; i < n; ++i) {
    if (x[i] == best) return i;
  }
  return n - 1;  // unreachable: the maximum is one of the elements
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.is_contiguous(),
              "argmax_rows: logits must be a contiguous (rows, vocab) float32 CPU tensor, got ",
              logits.scalar_type(), " ", logits.sizes());
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0 || rows == 0, "argmax_rows: rows of no logits have no argmax");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(agentx, lib) {
  lib.def("argmax_rows(Tensor logits) -> Tensor", &argmax_rows);
}

}  // namespace agentx
