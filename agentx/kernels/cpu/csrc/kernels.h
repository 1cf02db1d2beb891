// What one kernel file calls in another (the fused decoder layer uses the linear and attention
// kernels directly, on raw buffers, without going through the dispatcher).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace agentx {

// y (m, n) = x (m, k) W^T through a packed quantized weight (see qlinear.cpp); y rows are
// ldy floats apart. Each row's result depends on that row alone.
void quantized_linear_into(const float* x, int64_t m, int64_t k, const at::Tensor& qweight,
                           const at::Tensor& scale, const at::Tensor& mins, int64_t bits,
                           float* y, int64_t ldy);

// Paged attention of T query rows (q: (T, heads, head_dim) float32, contiguous) in place
// over the cache: row t belongs to request token_req[t] (its block table is row
// token_req[t] of tables, table_stride entries apart) and sees that request's first
// token_len[t] keys (window > 0: the last `window` of them). out: (T, heads, head_dim).
// A row's result is the same whatever other rows are in the call (decode or prefill).
void paged_attention_rows_into(const float* q, const at::Tensor& kv_cache, const int64_t* tables,
                               int64_t table_stride, const int64_t* token_req,
                               const int64_t* token_len, int64_t rows, int64_t heads,
                               float scale, int64_t window, float* out);

}  // namespace agentx
