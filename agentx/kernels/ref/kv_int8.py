"""The int8 KV cache: symmetric int8 with one float32 scale per (token, KV head).

An int8 cache has the usual layout with each (token, KV head) row ``SCALE_BYTES`` longer:
(num_blocks, 2, block_size, num_kv_heads, head_dim + 4) int8, the row's ``head_dim`` codes
followed by its scale's 4 bytes (native byte order). The scales live inside each block's page,
so whatever moves a block's bytes (offload tiers, Mooncake, disaggregated transfer) moves its
scales with it.

A row x (head_dim floats) is stored as scale = max|x| / 127 and codes round(x / scale) (half to
even, within [-127, 127]; an all-zero row has scale 0 and codes 0), and read back as
code * scale. A row's codes depend on that row alone, so the same token stores the same bytes
however its step was batched. The compiled writer (``cpu/csrc/kv_int8.cpp``) rounds the same
float32 operations and stores the same bytes.

The reference attention reads the cache dequantized, in float32. The compiled one
(``cpu/csrc/paged_attention.cpp``, "int8 caches") keeps the codes: a score is an exact integer
dot product of the key's codes with the query's own int16 codes (one scale a head), and a
chunk's probabilities, each times its value row's scale, enter the value sums as int16 codes
too (one scale a chunk), so its outputs are close to the reference's (within 2^-13 of the
largest value: ``tests/kernels/test_kv_int8.py``), not equal; every compiled path (AVX2 or
AVX-512, decoded or prefilled, alone or batched) gives the same bits.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def is_int8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.int8


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The head size a cache holds (its last dimension, less an int8 row's scale)."""
    return kv_cache.shape[-1] - (SCALE_BYTES if is_int8(kv_cache) else 0)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) -> its int8 rows (..., D + 4): codes then the float32 scale's bytes."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0  # (..., 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x / safe).clamp_(-127, 127).to(torch.int8)
    scale_bytes = scale.contiguous().view(torch.int8)  # (..., 4)
    return torch.cat([codes, scale_bytes], dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows (..., D + 4) -> (..., D) float32: code * scale."""
    codes = rows[..., :-SCALE_BYTES].float()
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # (..., 1)
    return codes * scale


def write_kv_int8(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Quantize new keys/values (T, Hkv, D) into their slots of an int8 cache."""
    block_size = kv_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv_cache[blocks, 0, offsets] = quantize_rows(k)
    kv_cache[blocks, 1, offsets] = quantize_rows(v)
