"""The attention layer every architecture uses: write new K/V to the paged cache, then attend.

It reads the step's layout from the forward context, so model code never sees block tables.
All KV writes of a step's batch happen before its reads (per layer), which is what lets a
request hit blocks another request of the same step is computing.

Under decode context parallel (``parallel.dcp_size = N``) the scheduler's block of B tokens is N
physical blocks of B / N, one per rank, and one block id names all of them; rank r keeps the
positions p with p % N == r::

    scheduler block j, offset o in [0, B)  ->  rank o % N, its block j, offset o // N

Each rank writes its own tokens, attends over them with their log-sum-exp, and the ranks' parts
merge exactly (``kernels/ref/attention_partial.py``); every rank ends with the whole output.
Under TP x DCP the merge runs in the dcp group of this rank's TP head shard: its ranks hold the
same heads, so the parts are (T, this shard's heads, D) on each.

Under prefill context parallel (``parallel.pcp_size = N``, the dcp ranks) a rank arrives with
only its rows of a long prefill (``parallel/prefill_split.py``): it gathers the step's q, k and
v from the group, runs the DCP path above over every row (its KV share written, every query
attended over its keys, the parts merged), and keeps its own rows. The attention is the DCP
attention bit for bit; the saving is in what runs around it (projections, MLP) on 1/N rows.
"""

from __future__ import annotations

import torch
from torch import nn

from agentx import kernels
from agentx.engine.models.forward_context import get_forward_context
from agentx.engine.parallel import SINGLE, ParallelState, PrefillSplit


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        layer_id: int,
        sliding_window: int | None = None,
        parallel: ParallelState = SINGLE,
    ) -> None:
        super().__init__()
        self.parallel = parallel
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
        if ctx.pcp is not None:
            return self._forward_pcp(q, k, v, kv_cache, meta, ctx.pcp)
        if self.parallel.dcp_size > 1:
            return self._forward_dcp(q, k, v, kv_cache, meta)
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

    def _forward_pcp(self, q, k, v, kv_cache, meta, split: PrefillSplit) -> torch.Tensor:
        """q (T_rank, H, D), k and v (T_rank, Hkv, D) of this rank's rows -> (T_rank, H, D):
        one gather of the step's q / k / v, then DCP attention over every row."""
        num_q, num_kv = q.shape[1], k.shape[1]
        qkv = split.gather(torch.cat([q, k, v], dim=1))  # (T, H + 2 Hkv, D)
        q, k, v = qkv.split([num_q, num_kv, num_kv], dim=1)
        out = self._forward_dcp(q, k.contiguous(), v.contiguous(), kv_cache, meta)  # (T, H, D)
        return out[split.own.to(out.device)]

    def _forward_dcp(self, q, k, v, kv_cache, meta) -> torch.Tensor:
        num_ranks, rank = self.parallel.dcp_size, self.parallel.dcp_rank
        block_size = kv_cache.shape[2]  # this rank's share of a scheduler block
        blocks, offsets = (
            meta.slot_mapping // (block_size * num_ranks),
            meta.slot_mapping % (block_size * num_ranks),
        )
        mine = offsets % num_ranks == rank
        local_slots = blocks * block_size + offsets // num_ranks
        kernels.write_kv(k[mine], v[mine], kv_cache, local_slots[mine])
        out, lse = kernels.paged_attention_partial(
            q,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            self.scale,
            num_ranks,
            rank,
        )
        outs, lses = self.parallel.dcp_all_gather(out), self.parallel.dcp_all_gather(lse)
        return kernels.merge_attention_parts(outs, lses).to(q.dtype)  # (T, H, D)
