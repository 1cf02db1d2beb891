"""Paged attention in plain PyTorch: the ground truth every other backend is tested against.

KV cache of one layer: (num_blocks, 2, block_size, num_kv_heads, head_dim), block first so one
pool page holds a block's K and V and pages of different KV groups can share memory; slot s lives
at block s // block_size, offset s % block_size. Grouped-query attention: query head h reads KV
head h // (num_heads // num_kv_heads). ``sliding_window=W``: a query at position p sees keys at
positions p - W + 1 .. p only. An int8 cache (``kv_int8.py``) is written quantized and read
dequantized to float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentx.kernels.ref.kv_int8 import dequantize_rows, is_int8, write_kv_int8


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values (T, Hkv, D) into their slots."""
    if is_int8(kv_cache):
        write_kv_int8(k, v, kv_cache, slot_mapping)
        return
    block_size = kv_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    # (num_blocks, 2, bs, Hkv, D) indexed -> (T, Hkv, D); a bf16 cache takes fp32 k, v
    kv_cache[blocks, 0, offsets] = k.to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = v.to(kv_cache.dtype)


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V, each (len(block_table) * block_size, Hkv, D) for one request or (B, L, Hkv, D).

    Each strided half is indexed on its own: that yields contiguous blocks, so merging
    (blocks, block_size) is a view and the context is copied once. An int8 cache's come back
    dequantized (float32).
    """
    k = kv_cache[:, 0][block_table]  # ([B,] nb, bs, Hkv, D)
    v = kv_cache[:, 1][block_table]
    if is_int8(kv_cache):
        k, v = dequantize_rows(k), dequantize_rows(v)
    dim = block_table.dim() - 1
    return k.flatten(dim, dim + 1), v.flatten(dim, dim + 1)


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
    token_req: torch.Tensor | None = None,
    token_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new queries q (T, H, D) over each request's paged context.

    ``token_req`` / ``token_len`` (each row's request and key count) are the row layout a
    compiled backend may take precomputed; this one derives everything from the lists.
    """
    out = torch.empty_like(q)
    block_size = kv_cache.shape[2]
    for i in prefill_ids:
        start, end = query_start_loc[i], query_start_loc[i + 1]
        seq_len = seq_lens[i]
        num_blocks = -(-seq_len // block_size)
        k, v = _gather(kv_cache, block_tables[i, :num_blocks])  # (L', Hkv, D)
        k, v = k[:seq_len].to(q.dtype), v[:seq_len].to(q.dtype)  # a bf16 cache, fp32 queries
        out[start:end] = _prefill_one(q[start:end], k, v, scale, sliding_window)
    if decode_ids.numel():
        out[_decode_rows(query_start_loc, decode_ids)] = _decode_batch(
            q, kv_cache, query_start_loc, seq_lens, block_tables, decode_ids, scale, sliding_window
        )
    return out


def paged_attention_with_lse(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    decode_ids: torch.Tensor,
    prefill_ids: list[int],
    scale: float,
    sliding_window: int | None = None,
    token_req: torch.Tensor | None = None,
    token_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention` and each row's natural-log log-sum-exp of its scores (T, H)
    float32: attention over disjoint key sets merges as sum_i exp(lse_i - lse) out_i.

    A request at a time, scores materialized: the ground truth, not a fast path.
    """
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    block_size = kv_cache.shape[2]
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        k, v = _gather(kv_cache, block_tables[i, : -(-seq_len // block_size)])  # (L', Hkv, D)
        k, v = k[:seq_len].float(), v[:seq_len].float()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (L, H, D)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale  # (H, Tq, L)
        qpos = torch.arange(seq_len - (end - start), seq_len).unsqueeze(1)
        kpos = torch.arange(seq_len).unsqueeze(0)
        visible = kpos <= qpos
        if sliding_window is not None:
            visible &= kpos > qpos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        lse[start:end] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out, lse


def _decode_rows(query_start_loc: list[int], decode_ids: torch.Tensor) -> torch.Tensor:
    starts = torch.tensor(query_start_loc[:-1], dtype=torch.long)
    return starts[decode_ids]


def _prefill_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None
) -> torch.Tensor:
    num_q, num_k = q.shape[0], k.shape[0]
    # 4-D inputs: PyTorch's CPU flash kernel takes only (B, H, T, D); 3-D is ~5x slower
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, T, D)
    if sliding_window is not None and num_k > sliding_window:
        qpos = torch.arange(num_k - num_q, num_k).unsqueeze(1)
        kpos = torch.arange(num_k).unsqueeze(0)
        mask = (kpos <= qpos) & (kpos > qpos - sliding_window)  # (Tq, Tk)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    elif num_q == num_k:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # query i sits at position num_k - num_q + i and sees keys 0..that position
        qpos = torch.arange(num_k - num_q, num_k).unsqueeze(1)
        mask = torch.arange(num_k).unsqueeze(0) <= qpos  # (Tq, Tk)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)  # (T, H, D)


def _decode_batch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    decode_ids: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per request, batched as a grouped matmul over padded contexts."""
    block_size = kv_cache.shape[2]
    lens = torch.tensor(seq_lens, dtype=torch.long)[decode_ids]
    max_len = int(lens.max())
    num_blocks = -(-max_len // block_size)
    k, v = _gather(kv_cache, block_tables[decode_ids, :num_blocks])  # (B, L, Hkv, D)
    k, v = k.to(q.dtype), v.to(q.dtype)
    num_kv_heads, head_dim = k.shape[-2:]
    qd = q[_decode_rows(query_start_loc, decode_ids)]  # (B, H, D)
    b = qd.shape[0]
    group = qd.shape[1] // num_kv_heads
    qd = qd.view(b, num_kv_heads, group, head_dim)  # (B, Hkv, G, D)
    scores = torch.matmul(qd, k.permute(0, 2, 3, 1)) * scale  # (B, Hkv, G, L)
    kpos = torch.arange(k.shape[1]).unsqueeze(0)
    valid = kpos < lens.unsqueeze(1)  # (B, L)
    if sliding_window is not None:
        valid &= kpos >= (lens - sliding_window).unsqueeze(1)
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.matmul(probs, v.transpose(1, 2))  # (B, Hkv, G, D)
    return o.reshape(b, num_kv_heads * group, head_dim)
