"""Attention over one rank's share of each request's KV, with its log-sum-exp (decode context
parallel), and the exact merge of the ranks' parts.

A request's keys are interleaved over N ranks: rank r holds the positions p with p % N == r, in
order, in its own blocks of the shared block table, so its k-th local key sits at position
k * N + r. Each rank attends over what it holds::

    o_r = softmax(q K_r^T * scale) V_r,  lse_r = log sum exp(q K_r^T * scale)  (causal by position)

and the parts merge as softmax over the union would: o = sum_r exp(lse_r - m) o_r / sum_r
exp(lse_r - m), m = max_r lse_r. A rank that holds no visible key for a query gives lse = -inf
and drops out of the merge; every query sees its own key, so some rank always holds one.

The part is computed in float64 and rounded to float32: a float32 matmul rounds differently
with the number of query rows (a prefix hit or a chunk changes it), and a token's attention must
not depend on how the step around it was batched; float64 sums rounded to float32 give the same
float32 whatever the order, but for values within a float64 error of a rounding boundary.
"""

from __future__ import annotations

import torch

from agentx.kernels.ref.attention import _gather


def paged_attention_partial(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
    num_ranks: int,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, D) of the step's new tokens (request i's are the last of its ``seq_lens[i]``
    positions) -> this rank's o (T, H, D) float32 and lse (T, H) float32."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32)
    lse = torch.full((num_tokens, num_heads), float("-inf"))
    block_size = kv_cache.shape[2]
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        num_local = max(0, -(-(seq_len - rank) // num_ranks))  # positions rank, rank + N, ...
        if start == end or num_local == 0:
            continue
        k, v = _gather(kv_cache, block_tables[i, : -(-num_local // block_size)])  # (L', Hkv, D)
        k, v = k[:num_local].double(), v[:num_local].double()
        o, part_lse = _attend(q[start:end].double(), k, v, scale, seq_len, num_ranks, rank)
        out[start:end], lse[start:end] = o.float(), part_lse.float()
    return out, lse


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    seq_len: int,
    num_ranks: int,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qg = q.view(num_q, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (Tq, Hkv, G, D)
    scores = torch.einsum("thgd,khd->thgk", qg, k) * scale  # (Tq, Hkv, G, Tk)
    kpos = torch.arange(k.shape[0]) * num_ranks + rank
    qpos = torch.arange(seq_len - num_q, seq_len)
    visible = kpos.unsqueeze(0) <= qpos.unsqueeze(1)  # (Tq, Tk)
    scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(scores - peak)
    total = weights.sum(dim=-1, keepdim=True)  # (Tq, Hkv, G, 1)
    o = torch.einsum("thgk,khd->thgd", weights, v) / total.clamp_min(torch.finfo(total.dtype).tiny)
    lse = (peak + torch.log(total)).squeeze(-1)  # -inf where nothing was visible
    return o.reshape(num_q, num_heads, head_dim), lse.reshape(num_q, num_heads)


def merge_attention_parts(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """outs (N, T, H, D), lses (N, T, H) -> the merged (T, H, D)."""
    peak = lses.amax(dim=0)  # (T, H), finite: each query sees its own key somewhere
    weights = torch.exp(lses - peak)  # (N, T, H)
    total = weights.sum(dim=0)
    return (weights.unsqueeze(-1) * outs).sum(dim=0) / total.unsqueeze(-1)
