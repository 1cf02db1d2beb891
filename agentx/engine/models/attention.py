"""The attention layer every architecture uses: write new K/V to the paged cache, then attend.

It reads the step's layout from the forward context, so model code never sees block tables.
All KV writes of a step's batch happen before its reads (per layer), which is what lets a
request hit blocks another request of the same step is computing.
"""

from __future__ import annotations

import torch
from torch import nn

from agentx import kernels
from agentx.engine.models.forward_context import get_forward_context


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        layer_id: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, H, D), k and v (T, Hkv, D) -> (T, H, D)."""
        ctx = get_forward_context()
        kv_cache = ctx.kv_caches[self.layer_id]
        meta = ctx.attn_for(self.layer_id)
        kernels.write_kv(k, v, kv_cache, meta.slot_mapping)
        return kernels.paged_attention(
            q,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.decode_ids,
            meta.prefill_ids,
            self.scale,
            sliding_window=self.sliding_window,
            token_req=meta.token_req,
            token_len=meta.token_len,
            **meta.kernel_options(),
        )
