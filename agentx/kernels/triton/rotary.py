"""Neox-style rotary embedding in Triton (``ref/ops.py``): one program rotates one token's
heads, in float32, with that token's (cos | sin) row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr,
    cs_ptr,
    out_ptr,
    num_heads,
    half,
    stride_xt,
    stride_xh,
    stride_cs,
    stride_ot,
    stride_oh,
    H_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < num_heads) & (i < half)
    cos = tl.load(cs_ptr + t * stride_cs + i, mask=i < half, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + t * stride_cs + half + i, mask=i < half, other=0.0).to(tl.float32)
    src = x_ptr + t * stride_xt + h * stride_xh + i
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + t * stride_ot + h * stride_oh + i
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D), cos_sin (T, D) -> rotated (T, H, D) in x's dtype."""
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cos_sin.stride(-1) != 1:
        cos_sin = cos_sin.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    half = head_dim // 2
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            x, cos_sin, out, num_heads, half,
            x.stride(0), x.stride(1), cos_sin.stride(0), out.stride(0), out.stride(1),
            H_PAD=triton.next_power_of_2(num_heads), HALF_PAD=triton.next_power_of_2(half),
        )  # fmt: skip
    return out
