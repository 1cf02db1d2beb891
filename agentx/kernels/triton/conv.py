"""Gated DeltaNet's depthwise causal conv1d in Triton (``ref/linear_attention.py``).

A program computes a (BT tokens, BC channels) tile of one sequence: tap j of output t reads
input t + j - (K - 1), which is x for indices >= 0 and the carried state before that::

    window   [ state: K-1 columns | x^T: T columns ]      out_t = sum_j w_j window[t + j]

The new state (the window's last K - 1 columns) is a slice, taken with PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentx.kernels.ref.linear_attention import conv_window

_BT, _BC = 16, 64


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr,
    num_tokens, num_channels,
    stride_xb, stride_xt, stride_sb, stride_sc, stride_ob, stride_ot,
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    t = tl.program_id(2) * BT + tl.arange(0, BT)
    c_ok = c < num_channels
    t_ok = t < num_tokens
    acc = tl.zeros([BT, BC], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(K):
        src = t + j - (K - 1)  # (BT,): < 0 reads the state
        mask = t_ok[:, None] & c_ok[None, :]
        xs = tl.load(
            x_ptr + b * stride_xb + src[:, None] * stride_xt + c[None, :],
            mask=mask & (src >= 0)[:, None],
            other=0.0,
        ).to(tl.float32)
        if HAS_STATE:
            xs += tl.load(
                state_ptr + b * stride_sb + c[None, :] * stride_sc + (K - 1 + src)[:, None],
                mask=mask & (src < 0)[:, None],
                other=0.0,
            ).to(tl.float32)
        w = tl.load(w_ptr + c * K + j, mask=c_ok, other=0.0).to(tl.float32)
        acc += xs * w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    dst = out_ptr + b * stride_ob + t[:, None] * stride_ot + c[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``ref/linear_attention.py``: x (B, T, C), weight (C, K), state (B, C, K-1) or None
    -> out (B, T, C), state after x (B, C, K-1)."""
    batch, num_tokens, num_channels = x.shape
    kernel_size = weight.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    if state is not None:
        state = state.to(x.dtype)
        if state.stride(-1) != 1:
            state = state.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if batch and num_tokens:
        grid = (batch, triton.cdiv(num_channels, _BC), triton.cdiv(num_tokens, _BT))
        s = state if state is not None else x
        _causal_conv1d_kernel[grid](
            x, weight, bias if bias is not None else weight, s, out,
            num_tokens, num_channels,
            x.stride(0), x.stride(1), s.stride(0), s.stride(1), out.stride(0), out.stride(1),
            K=kernel_size, BT=_BT, BC=_BC,
            HAS_STATE=state is not None, HAS_BIAS=bias is not None, SILU=silu,
        )  # fmt: skip
    tail = x[:, max(0, num_tokens - (kernel_size - 1)) :]  # the inputs the new state keeps
    new_state = conv_window(tail, state, kernel_size)[:, :, -(kernel_size - 1) :]
    return out, new_state
