"""Group-wise quantized linear layers in plain PyTorch: the packed weight layout and the math.

Weights are quantized along the input features in groups of 32 (``GROUP``):

    bits=4  w = scale * q + min,  q in 0..15      (GGUF Q4_1)
    bits=8  w = scale * q,        q in -127..127  (GGUF Q8_0)

and activations per row and group to int8 (``quantize_activations``): dx = amax / 127,
xq = rint(x * 127 / amax), sx = dx * sum(xq). The layer computes

    y[r, n] = sum_g scale[n, g] * dx[r, g] * (q[n, g, :] . xq[r, g, :]) (+ min[n, g] * sx[r, g])

The compiled CPU kernel (``kernels/cpu``) computes the same sum in another float order; its
packed layout (8 output columns a tile, see ``csrc/qlinear.cpp``) is built by ``pack_*`` here.
"""

from __future__ import annotations

import torch

from agentx.kernels.ref import kquant

GROUP = 32
TILE = 8


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) float32 -> xq (M, K) int8, dx (M, K/32), sx (M, K/32)."""
    m, k = x.shape
    groups = x.reshape(m, k // GROUP, GROUP)  # (M, G, 32)
    amax = groups.abs().amax(dim=-1)  # (M, G)
    dx = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(groups * inv.unsqueeze(-1))  # round half to even, as rint does
    sx = dx * xq.sum(dim=-1)
    return xq.to(torch.int8).reshape(m, k), dx, sx


def quantize_weight(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float (N, K) weight -> q (N, K) uint8 (bits=4) or int8 (bits=8), scale, min (N, K/32).

    bits=4 is asymmetric (Q4_1: the group's range over 15 steps from its minimum), bits=8
    symmetric (Q8_0: amax over 127 steps); min is zeros for bits=8.
    """
    n, k = w.shape
    groups = w.float().reshape(n, k // GROUP, GROUP)
    if bits == 8:
        amax = groups.abs().amax(dim=-1)
        scale = amax / 127.0
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        q = torch.round(groups * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return q.reshape(n, k), scale, torch.zeros_like(scale)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = (hi - lo) / 15.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round((groups - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15)
    return q.to(torch.uint8).reshape(n, k), scale, lo


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """q (N, K), scale and min (N, K/32) -> the float32 (N, K) weight they stand for."""
    n, k = q.shape
    groups = q.float().reshape(n, k // GROUP, GROUP)
    return (groups * scale.unsqueeze(-1) + mins.unsqueeze(-1)).reshape(n, k)


def pack_weight(
    q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's tiled layout: (qweight, scale, min), each tile 8 output columns.

    bits=4 qweight (N/8, K/8, 32) uint8: low nibble q[8t + j//4, 8o + j%4],
                                         high nibble q[8t + j//4, 8o + 4 + j%4]
    bits=8 qweight (N/8, K/4, 32) int8:  q[8t + j//4, 4u + j%4]
    scale, min (N/8, K/32, 8) float32
    """
    n, k = q.shape
    if bits == 4:
        nib = q.reshape(n // TILE, TILE, k // 8, 2, 4).permute(0, 2, 1, 4, 3)  # (t, o, c, kk, h)
        packed = (nib[..., 0] | (nib[..., 1] << 4)).reshape(n // TILE, k // 8, 32)
    else:
        packed = (
            q.reshape(n // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3).reshape(n // TILE, -1, 32)
        )
    return packed.contiguous(), _tile_groups(scale), _tile_groups(mins)


def unpack_weight(
    packed: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_weight`: (q (N, K), scale (N, K/32), min (N, K/32))."""
    tiles = packed.shape[0]
    n = tiles * TILE
    if bits == 4:
        lo, hi = packed & 0x0F, packed >> 4  # (t, o, 32)
        octets = packed.shape[1]
        nib = torch.stack((lo, hi), dim=-1).reshape(tiles, octets, TILE, 4, 2)  # (t, o, c, kk, h)
        q = nib.permute(0, 2, 1, 4, 3).reshape(n, octets * 8)
    else:
        quads = packed.shape[1]
        q = packed.reshape(tiles, quads, TILE, 4).permute(0, 2, 1, 3).reshape(n, quads * 4)
    return q, _untile_groups(scale), _untile_groups(mins)


def quantized_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None,
    bits: int,
) -> torch.Tensor:
    """x (M, K) float32 times the packed weight -> (M, N) float32 (the kernel's contract);
    ``bits`` a GGML K-quant type: the weight is that type's blocks (``kquant.py``)."""
    if bits in kquant.KQUANT_TYPES:
        return kquant.kquant_linear(x, qweight, bits, bias)
    q, w_scale, w_min = unpack_weight(qweight, scale, mins, bits)
    n, k = q.shape
    xq, dx, sx = quantize_activations(x)
    # exact integer dots per group (int64), then the float scales
    dots = torch.einsum(
        "mgk,ngk->mng",
        xq.long().reshape(-1, k // GROUP, GROUP),
        q.long().reshape(n, k // GROUP, GROUP),
    ).float()  # (M, N, G)
    y = (dots * w_scale.unsqueeze(0) * dx.unsqueeze(1)).sum(-1)
    if bits == 4:
        y = y + sx @ w_min.t()
    return y if bias is None else y + bias


def _tile_groups(values: torch.Tensor) -> torch.Tensor:
    n, g = values.shape
    return values.float().reshape(n // TILE, TILE, g).permute(0, 2, 1).contiguous()


def _untile_groups(values: torch.Tensor) -> torch.Tensor:
    tiles, g, _ = values.shape
    return values.permute(0, 2, 1).reshape(tiles * TILE, g)
