"""Paged attention in Triton: one kernel for chunked prefill over cached context and decode.

Same layout and contract as ``ref/attention.py``; it also returns each row's log-sum-exp so
attention over disjoint key sets (context-parallel shards) can be merged exactly.

One program owns one query tile of one request and one KV head. Its rows are (token, query
head of the KV head's group) pairs, so GQA shares every loaded key across the group::

    rows m = qi * GROUP + g       qi < BLOCK_Q tokens of the tile, g < GROUP heads
    tiles of request i:           cu_q[i] // BLOCK_Q + i  ..  (an upper bound; extras exit)

The flat tile index is mapped back to its request by a binary search over ``cu_q``, so the grid
needs no host-built tile list (and a CUDA graph can replay it with new lengths). Long contexts
are split over ``NUM_SPLITS`` programs (split-KV); their partial outputs and log-sum-exps are
merged by :func:`_merge_kernel`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from agentx.errors import ConfigError

_LOG2E = 1.4426950408889634


@triton.jit
def _find_request(cu_q_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """The last request whose first tile index is <= ``tile``."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    lse_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    block_table_ptr,
    scale_log2,
    num_reqs,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kv,
    stride_ks,
    stride_kh,
    stride_bt,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = _find_request(cu_q_ptr, num_reqs, tile, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + req)
    q_len = tl.load(cu_q_ptr + req + 1) - q_start
    first = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if first >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + req) - q_len  # keys before the first new token

    m = tl.arange(0, BLOCK_M)
    qi = m // GROUP
    head = kv_head * GROUP + m % GROUP
    row = first + qi
    row_ok = (qi < BLOCK_Q) & (row < q_len)
    qpos = ctx_len + row  # a row sees keys 0 .. qpos (qpos - window + 1 .. qpos with a window)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    tok = (q_start + row).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (BLOCK_M, D_PAD)

    # the tile's key range [lo, hi), cut into NUM_SPLITS runs of whole BLOCK_N tiles
    hi = ctx_len + tl.minimum(first + BLOCK_Q, q_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx_len + first - window + 1, 0)
    per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), NUM_SPLITS) * BLOCK_N
    n_begin = lo + split * per_split
    n_end = tl.minimum(n_begin + per_split, hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start in range(n_begin, n_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < n_end
        block = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        base = kv_ptr + block * stride_kb + (n % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(base[:, None] + d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, D_PAD)
        v = tl.load(base[:, None] + stride_kv + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        visible = n_ok[None, :] & (n[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            visible = visible & (n[None, :] > qpos[:, None] - window)
        s = tl.where(visible, s * scale_log2, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    o_ptr = out_ptr + split * stride_os + tok[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(o_ptr + d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok)
    tl.store(lse_ptr + split * stride_ls + tok * stride_lt + head, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    part_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """out = sum_s exp(lse_s - lse) o_s with lse = log sum_s exp(lse_s), per (token, head)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < NUM_SPLITS
    part_lse = tl.load(
        part_lse_ptr + s * stride_ls + t * stride_lt + h, mask=s_ok, other=float("-inf")
    )
    top = tl.max(part_lse, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(part_lse - top_safe)  # (S_PAD,)
    total = tl.sum(w, 0)
    parts = tl.load(
        part_ptr + s[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
        mask=s_ok[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    o = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    dst = out_ptr + t * stride_ot + h * stride_oh + d
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
    tl.store(lse_ptr + t * stride_lt + h, tl.where(total == 0.0, top, top_safe + tl.log(total)))


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: list[int] | torch.Tensor,
    seq_lens: list[int] | torch.Tensor,
    block_tables: torch.Tensor,
    decode_ids: torch.Tensor | None = None,
    prefill_ids: list[int] | None = None,
    scale: float = 1.0,
    sliding_window: int | None = None,
    token_req: torch.Tensor | None = None,
    token_len: torch.Tensor | None = None,
    **launch,
) -> torch.Tensor:
    """See ``ref/attention.py``; ``launch`` as in :func:`paged_attention_with_lse`."""
    return paged_attention_with_lse(
        q, kv_cache, query_start_loc, seq_lens, block_tables, scale=scale,
        sliding_window=sliding_window, **launch,
    )[0]  # fmt: skip


def paged_attention_with_lse(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: list[int] | torch.Tensor,
    seq_lens: list[int] | torch.Tensor,
    block_tables: torch.Tensor,
    decode_ids: torch.Tensor | None = None,
    prefill_ids: list[int] | None = None,
    scale: float = 1.0,
    sliding_window: int | None = None,
    token_req: torch.Tensor | None = None,
    token_len: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (T, H, D) in q's dtype and the natural-log LSE (T, H) float32 of every row.

    ``query_start_loc`` / ``seq_lens`` may already be int32 device tensors (a CUDA graph's
    static buffers); then ``max_query_len`` and ``num_splits`` must be given, as the grid is
    fixed on the host. ``decode_ids`` / ``prefill_ids`` / ``token_*`` are not needed: one
    kernel serves every row.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ConfigError(f"paged_attention: q {tuple(q.shape)} vs cache {tuple(kv_cache.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    cu_q, lens, max_query_len, max_seq_len = _device_layout(
        q.device, query_start_loc, seq_lens, max_query_len, max_seq_len
    )
    num_reqs = lens.shape[0]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = 1 if max_query_len == 1 else max(1, 64 // group_pad)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    d_pad = max(16, triton.next_power_of_2(head_dim))
    block_n = block_n or (64 if d_pad <= 128 else 32)
    num_tiles = num_tokens // block_q + num_reqs
    if num_splits is None:
        num_splits = choose_num_splits(q.device, num_tiles * num_kv_heads, max_seq_len, block_n)
    out = torch.empty_like(q)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    if num_tokens == 0:
        return out, lse
    if num_splits == 1:
        part, part_lse, part_strides = out, lse, (0, 0)
    else:
        part = torch.empty(num_splits, num_tokens, num_heads, head_dim, device=q.device)
        part_lse = torch.empty(num_splits, num_tokens, num_heads, device=q.device)
        part_strides = (part.stride(0), part_lse.stride(0))
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, kv_cache, part, part_lse, cu_q, lens, block_tables,
        scale * _LOG2E, num_reqs, sliding_window or 0,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        part_strides[0], part.stride(-3), part.stride(-2),
        part_strides[1], part_lse.stride(-2),
        GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        HAS_WINDOW=sliding_window is not None, IEEE=q.dtype == torch.float32,
    )  # fmt: skip
    if num_splits > 1:
        _merge_kernel[(num_tokens, num_heads)](
            part, part_lse, out, lse,
            part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), lse.stride(0),
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, D_PAD=d_pad,
        )  # fmt: skip
    return out, lse


class _LayoutCache:
    """The last step's host lists and their device copies: every layer of a step passes the
    same list objects, so they cross to the device once a step."""

    __slots__ = ("key", "value")

    def __init__(self) -> None:
        self.key: tuple = ()
        self.value: tuple = ()


_LAST = _LayoutCache()


def _device_layout(
    device: torch.device,
    query_start_loc: list[int] | torch.Tensor,
    seq_lens: list[int] | torch.Tensor,
    max_query_len: int | None,
    max_seq_len: int | None,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    if isinstance(query_start_loc, torch.Tensor):
        if max_query_len is None:
            raise ConfigError("paged_attention: device query_start_loc needs max_query_len")
        return query_start_loc, seq_lens, max_query_len, max_seq_len or 0
    key = _LAST.key
    if key and key[0] is query_start_loc and key[1] is seq_lens and key[2] == device:
        return _LAST.value
    cu_q = torch.tensor(query_start_loc, dtype=torch.int32).to(device, non_blocking=True)
    lens = torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True)
    pairs = zip(query_start_loc, query_start_loc[1:], strict=False)
    max_q = max((b - a for a, b in pairs), default=0)
    _LAST.key = (query_start_loc, seq_lens, device)
    _LAST.value = (cu_q, lens, max_q, max(seq_lens, default=0))
    return _LAST.value


def choose_num_splits(
    device: torch.device, num_programs: int, max_seq_len: int, block_n: int
) -> int:
    """Split the keys when the grid alone would leave most SMs idle and contexts are long."""
    if device.type != "cuda" or max_seq_len <= 4 * block_n:
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = math.ceil(2 * num_sms / max(num_programs, 1))
    return max(1, min(wanted, 32, max_seq_len // (4 * block_n)))
