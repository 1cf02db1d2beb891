"""RMSNorm in Triton: plain, with the residual add fused in, and gated (``ref/ops.py``).

One program normalizes one row; the row is read once, its sum of squares taken in float32.
Rounding follows the reference: the normalized row is rounded to x's dtype before the weight
multiplies it, and the product is rounded to the promoted dtype of (x, weight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    gate_ptr,
    w_ptr,
    out_ptr,
    eps,
    n,
    stride_x,
    stride_r,
    stride_g,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_GATE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * n + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    normed = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(out_ptr.dtype.element_ty)
    if HAS_GATE:
        gate = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) * gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n + cols, y, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])  # (R, N): a view when it can be
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
    residual: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    rows = _rows(x)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_rows = _rows(residual) if residual is not None else rows
    res_out = torch.empty_like(x) if residual is not None else None
    gate_rows = _rows(gate) if gate is not None else rows
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res_rows, res_out if res_out is not None else out, gate_rows, weight, out,
            eps, n, rows.stride(0), res_rows.stride(0), gate_rows.stride(0),
            BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None,
            HAS_GATE=gate is not None,
        )  # fmt: skip
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, weight, eps, torch.result_type(x, weight))[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass (see ``ref/ops.py``)."""
    out, res_out = _launch(x, weight, eps, torch.result_type(x, weight), residual=residual)
    return out, res_out


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return _launch(x, weight, eps, x.dtype, gate=gate)[0]
