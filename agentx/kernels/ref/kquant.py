"""GGUF K-quant linear layers (Q4_K, Q6_K) in plain PyTorch: the block layout and the math.

A K-quant weight row is a run of super-blocks of 256 input features, kept as the file's bytes
(``qweight`` (N, K/256 * block_bytes) uint8). Per super-block (llama.cpp's ``block_q4_K`` /
``block_q6_K``)::

    Q4_K  144 bytes: d fp16 | dmin fp16 | scales[12] (8 x (6-bit sc, 6-bit m)) | qs[128]
          qs chunk c (32 bytes, c = 0..3): low nibbles are elements 64c..64c+31 (sub-block 2c),
          high nibbles 64c+32..64c+63 (sub-block 2c+1); w = (d * sc[j]) * q - dmin * m[j]
    Q6_K  210 bytes: ql[128] | qh[64] | scales[16] int8 | d fp16
          element 128h + 32t + l (h = 0..1, t = 0..3, l = 0..31): low 4 bits from ql[64h + l]
          (t = 0, 2: low / high nibble) or ql[64h + 32 + l] (t = 1, 3), high 2 bits are bits
          2t..2t+1 of qh[32h + l]; w = (d * sc[e / 16]) * (q - 32)

:func:`dequantize` gives ``gguf.quants.dequantize``'s floats bit for bit. The layer quantizes
each activation row per super-block to int8 (``quantize_activations``: dx = amax / 127,
xq = rint(x * 127 / amax), and the sums of xq per 16) and computes, per row r and column n,
exact integer sums per super-block b, then float32 steps in this fixed order::

    Q4_K  S1 = sum_j sc[j] (q_j . xq_j)        S2 = sum_j m[j] sum(xq_j)     (j: 8 x 32)
          t  = d * float(S1) - dmin * float(S2)
    Q6_K  S  = sum_j sc[j] (q_j . xq_j) - 32 sum_j sc[j] sum(xq_j)           (j: 16 x 16)
          t  = d * float(S)
    acc = 0; for b in order: acc = acc + dx[r, b] * t[b]        (each step rounded, no FMA)

The compiled kernels (``cpu/csrc/qlinear_kquant*.cpp``) compute the same steps and so give the
same bits on every ISA and batch shape.
"""

from __future__ import annotations

import torch

__all__ = [
    "BLOCK",
    "KQUANT_TYPES",
    "Q4_K",
    "Q6_K",
    "block_bytes",
    "dequantize",
    "kquant_linear",
    "quantize_activations",
    "unpack",
]

BLOCK = 256
# GGML type ids (gguf.GGMLQuantizationType): also the ``bits`` code of a K-quant layer
Q4_K = 12
Q6_K = 14
KQUANT_TYPES = {Q4_K: 144, Q6_K: 210}  # type -> bytes a super-block


def block_bytes(kind: int) -> int:
    return KQUANT_TYPES[kind]


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 little-endian -> (...) float32 (exact)."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def unpack(qweight: torch.Tensor, kind: int) -> dict[str, torch.Tensor]:
    """Raw blocks (N, B * block_bytes) -> the integers and scales of every super-block.

    Q4_K: q (N, B, 256) 0..15, sc and m (N, B, 8), d and dmin (N, B).
    Q6_K: q (N, B, 256) 0..63 (not yet minus 32), sc (N, B, 16) signed, d (N, B).
    """
    n = qweight.shape[0]
    blocks = qweight.reshape(n, -1, block_bytes(kind))  # (N, B, bytes)
    if kind == Q4_K:
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        s = blocks[..., 4:16].long()  # (N, B, 12)
        sc = torch.cat((s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)), -1)
        m = torch.cat((s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)), -1)
        qs = blocks[..., 16:].reshape(n, -1, 4, 1, 32)  # (N, B, chunk, 1, 32)
        q = torch.cat((qs & 0xF, qs >> 4), dim=3).reshape(n, -1, BLOCK)
        return {"q": q, "sc": sc, "m": m, "d": d, "dmin": dmin}
    if kind == Q6_K:
        ql = blocks[..., 0:128].reshape(n, -1, 2, 1, 64)  # (N, B, h, 1, 64)
        ql = torch.cat((ql & 0xF, ql >> 4), dim=3).reshape(n, -1, 2, 4, 32)  # (N, B, h, t, 32)
        qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qweight.device).reshape(4, 1)
        qh = (qh >> shifts) & 3  # (N, B, h, t, 32)
        q = (ql | (qh << 4)).reshape(n, -1, BLOCK)
        sc = blocks[..., 192:208].contiguous().view(torch.int8).long()
        return {"q": q, "sc": sc, "d": _f16(blocks[..., 208:210])}
    raise ValueError(f"not a K-quant type: {kind}")


def dequantize(qweight: torch.Tensor, kind: int) -> torch.Tensor:
    """(N, B * block_bytes) uint8 -> (N, 256 B) float32, as ``gguf.quants.dequantize``."""
    u = unpack(qweight, kind)
    n = qweight.shape[0]
    if kind == Q4_K:
        scale = (u["d"].unsqueeze(-1) * u["sc"].float()).unsqueeze(-1)  # (N, B, 8, 1)
        shift = (u["dmin"].unsqueeze(-1) * u["m"].float()).unsqueeze(-1)
        q = u["q"].reshape(n, -1, 8, 32).float()
        return (scale * q - shift).reshape(n, -1)
    scale = (u["d"].unsqueeze(-1) * u["sc"].float()).unsqueeze(-1)  # (N, B, 16, 1)
    q = u["q"].reshape(n, -1, 16, 16).float() - 32
    return (scale * q).reshape(n, -1)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) float32 -> xq (M, K) int8, dx (M, K/256) float32, sums (M, K/256, 16) of xq
    per 16 features."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)  # (M, B, 256)
    amax = blocks.abs().amax(dim=-1)  # (M, B)
    # tensor / tensor: true divisions (``127.0 / amax`` would be 127 * reciprocal(amax), two
    # roundings, not the kernel's one)
    c127 = torch.full_like(amax, 127.0)
    dx = amax / c127
    inv = torch.where(amax > 0, c127 / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv.unsqueeze(-1))  # round half to even, as rint does
    sums = xq.reshape(m, k // BLOCK, 16, 16).sum(-1).long()
    return xq.to(torch.int8).reshape(m, k), dx, sums


def kquant_linear(
    x: torch.Tensor, qweight: torch.Tensor, kind: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (M, K) float32 times the K-quant weight (N, K/256 * block_bytes) -> (M, N) float32."""
    m, k = x.shape
    n, num_blocks = qweight.shape[0], k // BLOCK
    if qweight.shape[1] != num_blocks * block_bytes(kind):
        raise ValueError(f"K-quant weight of {qweight.shape[1]} bytes a row does not fit K={k}")
    u = unpack(qweight, kind)
    xq, dx, sums = quantize_activations(x)
    sub = 8 if kind == Q4_K else 16  # sub-blocks a super-block
    # exact integer dots per sub-block: (M, N, B, sub)
    dots = torch.einsum(
        "mbsk,nbsk->mnbs",
        xq.long().reshape(m, num_blocks, sub, -1),
        u["q"].long().reshape(n, num_blocks, sub, -1),
    )
    sc = u["sc"].unsqueeze(0)  # (1, N, B, sub)
    if kind == Q4_K:
        sums32 = sums.reshape(m, num_blocks, 8, 2).sum(-1).unsqueeze(1)  # (M, 1, B, 8)
        s1 = (sc * dots).sum(-1).double().float()
        s2 = (u["m"].unsqueeze(0) * sums32).sum(-1).double().float()
        t = u["d"] * s1 - u["dmin"] * s2  # (M, N, B)
    else:
        s = (sc * dots).sum(-1) - 32 * (sc * sums.unsqueeze(1)).sum(-1)
        t = u["d"] * s.double().float()
    acc = torch.zeros(m, n, dtype=torch.float32)
    for b in range(num_blocks):
        acc = acc + dx[:, b : b + 1] * t[:, :, b]
    return acc if bias is None else acc + bias
