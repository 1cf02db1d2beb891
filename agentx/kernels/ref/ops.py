"""Pointwise model ops in plain PyTorch (the reference backend)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> gelu(gate, tanh approximation) * up (GeGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding of x (T, H, D).

    ``cos_sin`` is (T, D): each token's cos in the first half, sin in the second.
    """
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # (T, 1, D/2)
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of x, then times silu(gate) (norm before gate, as Gated DeltaNet's output norm)."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    normed = (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight
    return (normed.float() * F.silu(gate.float())).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm residual step: (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual
