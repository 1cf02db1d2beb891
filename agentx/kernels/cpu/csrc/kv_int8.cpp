// The int8 KV cache's writer (kernels/ref/kv_int8.py has the format): each (token, KV head)
// row of head_dim floats is stored as codes round(x / s) (half to even, within [-127, 127])
// followed by s = max|x| / 127 as float32; an all-zero row stores s = 0 and zero codes. The same
// float32 operations as the reference, so both store the same bytes for the same row.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace agentx {

int64_t kv_head_dim(const at::Tensor& kv_cache) {
  return kv_cache.size(4) - (kv_cache.scalar_type() == at::kChar ? 4 : 0);
}

namespace {

void quantize_row(const float* x, int64_t d, int8_t* out) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = amax / 127.f;
  for (int64_t i = 0; i < d; ++i) {
    const float c = s > 0.f ? std::nearbyint(x[i] / s) : 0.f;
    out[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, c)));
  }
  std::memcpy(out + d, &s, sizeof(s));
}

}  // namespace

void write_kv_rows_int8(const float* k, const float* v, int64_t ld, int64_t rows,
                        int64_t num_kv_heads, int64_t head_dim, int8_t* cache,
                        int64_t block_stride, int64_t block_size, const int64_t* slots) {
  const int64_t row = head_dim + 4, token_stride = num_kv_heads * row;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t block = slots[r] / block_size, offset = slots[r] % block_size;
    int8_t* kc = cache + block * block_stride + offset * token_stride;
    int8_t* vc = kc + block_size * token_stride;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      quantize_row(k + r * ld + h * head_dim, head_dim, kc + h * row);
      quantize_row(v + r * ld + h * head_dim, head_dim, vc + h * row);
    }
  }
}

namespace {

// k, v (T, Hkv, D) float32 into an int8 cache (num_blocks, 2, block_size, Hkv, D + 4)
void write_kv_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
                   const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.scalar_type() == at::kChar && kv_cache.dim() == 5,
              "kv_cache must be an int8 cache");
  TORCH_CHECK(kv_cache.stride(4) == 1 && kv_cache.stride(3) == kv_cache.size(4) &&
                  kv_cache.stride(2) == kv_cache.size(3) * kv_cache.size(4) &&
                  kv_cache.stride(1) == kv_cache.size(2) * kv_cache.stride(2),
              "kv_cache: each block must be dense");
  const int64_t d = kv_head_dim(kv_cache), hkv = kv_cache.size(3);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == hkv && k.size(2) == d,
              "k and v must be (T, num_kv_heads, head_dim)");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == k.size(0),
              "slot_mapping: one int64 per row");
  const at::Tensor kc = k.to(at::kFloat).contiguous(), vc = v.to(at::kFloat).contiguous();
  const at::Tensor slots = slot_mapping.contiguous();
  write_kv_rows_int8(kc.data_ptr<float>(), vc.data_ptr<float>(), hkv * d, kc.size(0), hkv, d,
                     kv_cache.data_ptr<int8_t>(), kv_cache.stride(0), kv_cache.size(2),
                     slots.data_ptr<int64_t>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(agentx, lib) {
  lib.def("write_kv_int8(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  lib.impl("write_kv_int8", c10::DispatchKey::CPU, &write_kv_int8);
}

}  // namespace agentx
