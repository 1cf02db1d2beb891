"""Compiled CPU kernels (C++, AVX2): quantized linear layers and paged decode attention.

Same signatures as the reference backend (``kernels/ref``), which is their ground truth; the
library builds on first use (``build.py``). Callers check :func:`available` first.
"""

from __future__ import annotations

import torch

from agentx.kernels.cpu.build import available
from agentx.kernels.ref import attention as _ref_attention

__all__ = ["available", "paged_attention", "quantized_linear"]


def quantized_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None,
    bits: int,
) -> torch.Tensor:
    """x (M, K) float32 -> (M, N) float32 through the packed weight (see ``ref/quant.py``)."""
    return torch.ops.agentx.quantized_linear(x, qweight, scale, mins, bias, bits)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    decode_ids: torch.Tensor,
    prefill_ids: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The reference contract; decode rows read the paged cache in place (C++), prefill rows
    go through the reference's SDPA path."""
    if not prefill_ids and len(seq_lens) == q.shape[0]:  # every row decodes, in order
        return _decode(q, kv_cache, block_tables, torch.tensor(seq_lens), scale, sliding_window)
    out = torch.empty_like(q)
    if prefill_ids:
        no_decodes = torch.empty(0, dtype=torch.long)
        out = _ref_attention.paged_attention(
            q,
            kv_cache,
            query_start_loc,
            seq_lens,
            block_tables,
            no_decodes,
            prefill_ids,
            scale,
            sliding_window,
        )
    if decode_ids.numel():
        rows = torch.tensor(query_start_loc[:-1], dtype=torch.long)[decode_ids]
        lens = torch.tensor(seq_lens, dtype=torch.long)[decode_ids]
        out[rows] = _decode(
            q[rows], kv_cache, block_tables[decode_ids], lens, scale, sliding_window
        )
    return out


def _decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    out = torch.ops.agentx.paged_decode_attention(
        q.float(), kv_cache, block_tables, seq_lens, scale, sliding_window or 0
    )
    return out.to(q.dtype)
