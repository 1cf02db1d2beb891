"""KV write in Triton: new keys/values into their paged-cache slots (``ref/attention.py``).

One program per new token copies its (Hkv, D) key and value rows, cast to the cache's dtype.
A negative slot is skipped: a padded row of a CUDA-graph batch writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    dst = dst + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values (T, Hkv, D) into their slots (see ``ref/attention.py``)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    _write_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping, kv_cache.shape[2],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip
