"""Gated activations in Triton: x = [gate | up] -> act(gate) * up (``ref/ops.py``).

A 2-D grid: one row per program along axis 0, ``BLOCK`` output columns along axis 1. The
activation is computed in float32 and rounded to x's dtype before the multiply, as PyTorch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, n, stride_x, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 * tl.sigmoid(2.0 * inner))  # 1 + tanh(y) = 2 sigmoid(2y)
    else:
        act = gate * tl.sigmoid(gate)
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    n = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if rows.shape[0] and n:
        block = min(_BLOCK, triton.next_power_of_2(n))
        grid = (rows.shape[0], triton.cdiv(n, block))
        _act_and_mul_kernel[grid](rows, out, n, rows.stride(0), BLOCK=block, GELU_TANH=gelu_tanh)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, gelu_tanh=True)
