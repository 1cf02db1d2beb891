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

// Which vector instructions the kernels use: kIsaAvx2, or kIsaAvx512 (AVX-512 VNNI) when the
// CPU has it (the default there). set >= 0 chooses (tests compare the two); -1 only reads.
constexpr int64_t kIsaAvx2 = 0;
constexpr int64_t kIsaAvx512 = 1;
int64_t kernel_isa(int64_t set);
bool cpu_has_avx512_vnni();

// AVX-512 VNNI tiles [t0, t1) (an even count) of up to 4 rows (qlinear_avx512.cpp); out[r]
// points at row r's column 8 t0. The same arithmetic as qlinear.cpp's AVX2 tiles.
void quantized_tiles_avx512(int64_t rows, int64_t t0, int64_t t1, bool int4, const uint8_t* w,
                            int64_t tile_bytes, const float* scale, const float* mins,
                            const int8_t* xq, const float* dx, const float* sx, int64_t k,
                            float* const* out);

}  // namespace agentx
