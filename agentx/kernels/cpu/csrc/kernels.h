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

// The int8 KV cache (kv_int8.cpp): the head size a cache holds (its last dimension, less an
// int8 row's 4-byte scale), and the quantizing writer of T rows of K and V (row r's Hkv heads
// at k + r * ld, v + r * ld) into their slots.
int64_t kv_head_dim(const at::Tensor& kv_cache);
void write_kv_rows_int8(const float* k, const float* v, int64_t ld, int64_t rows,
                        int64_t num_kv_heads, int64_t head_dim, int8_t* cache,
                        int64_t block_stride, int64_t block_size, const int64_t* slots);

// Which instructions the kernels use: kIsaAvx2; kIsaAvx512 (AVX-512 VNNI); or kIsaAmx (those
// and AMX int8 tiles for the K-quant GEMM), each where the CPU has it, the highest by
// default. set >= 0 chooses (tests compare them; all give the same bits); -1 only reads.
constexpr int64_t kIsaAvx2 = 0;
constexpr int64_t kIsaAvx512 = 1;
constexpr int64_t kIsaAmx = 2;
int64_t kernel_isa(int64_t set);
bool cpu_has_avx512_vnni();
bool cpu_has_amx();  // AMX-TILE and AMX-INT8, and the OS lets this process use them

// AVX-512 VNNI tiles [t0, t1) (an even count) of up to kRowsWide (6) rows (qlinear_avx512.cpp);
// out[r] points at row r's column 8 t0. The same arithmetic as qlinear.cpp's AVX2 tiles. xsum
// (int8 weights; null for int4): 128 times each (row, group)'s sum of xq. The weights of tiles
// [fetch0, fetch1) (none when equal) are brought into the caches while these are read, spread
// evenly over them: into L1, or with to_l2 into L2.
void quantized_tiles_avx512(int64_t rows, int64_t t0, int64_t t1, bool int4, const uint8_t* w,
                            int64_t tile_bytes, const float* scale, const float* mins,
                            const int8_t* xq, const float* dx, const float* sx,
                            const int32_t* xsum, int64_t k, float* const* out, int64_t fetch0,
                            int64_t fetch1, bool to_l2);

// GGUF K-quant weights (qlinear_kquant.cpp): the type ids are GGML's, and a layer's "bits"
// may be one of them (quantized_linear_into then multiplies through the K-quant kernel).
constexpr int64_t kQ4K = 12;
constexpr int64_t kQ6K = 14;
inline bool is_kquant(int64_t bits) { return bits == kQ4K || bits == kQ6K; }

// y (m, n) = x (m, k) W^T with W the file's super-blocks (qweight (n, k/256 * block bytes)
// uint8); y rows ldy floats apart. Each row's result depends on that row alone.
void kquant_linear_into(const float* x, int64_t m, int64_t k, const at::Tensor& qweight,
                        int64_t type, float* y, int64_t ldy);

// From kKquantGemmRows rows on, kquant_linear_into hands the quantized rows (xq, dx, sums as
// kquant.h's Rows) to the GEMM of its ISA (qlinear_kquant_gemm.cpp, _avx512.cpp): all n
// columns into y, the same bits.
constexpr int64_t kKquantGemmRows = 32;  // measured: at 16 rows down (K = 8960) ran slower
// AVX-512's GEMM from 16 rows (Zen 4, Qwen2.5-Coder-1.5B's shapes: at 16 rows 5-30% faster
// than 4 groups of 4). With weights in cache it wins from 8 rows too, but an 8 x 2K decode step
// (weights from DRAM) took 94 ms with it against 78-81 ms on the row groups.
constexpr int64_t kKquantGemmRowsAvx512 = 16;
void kquant_gemm_avx2(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n,
                      const int8_t* xq, const float* dx, const int16_t* sums, int64_t k,
                      int64_t m, float* y, int64_t ldy);
void kquant_gemm_avx512(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n,
                        const int8_t* xq, const float* dx, const int16_t* sums, int64_t k,
                        int64_t m, float* y, int64_t ldy);
// AMX (qlinear_kquant_gemm_amx.cpp), from kKquantGemmRowsAmx rows (measured: at 16 and 32
// rows slower than the AVX-512 GEMM, which takes them): the same bits.
constexpr int64_t kKquantGemmRowsAmx = 64;
void kquant_gemm_amx(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n,
                     const int8_t* xq, const float* dx, const int16_t* sums, int64_t k, int64_t m,
                     float* y, int64_t ldy);

// AVX-512 VNNI: columns [n0, n1) of activation rows [r0, r0 + rows) (rows <= 4) into y (row
// r at y + r * ldy); xq, dx, sums as kquant.h's Rows. The same sums and steps as AVX2's.
void kquant_columns_avx512(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t n0,
                           int64_t n1, const int8_t* xq, const float* dx, const int16_t* sums,
                           int64_t k, int64_t r0, int64_t rows, float* y, int64_t ldy);

}  // namespace agentx
