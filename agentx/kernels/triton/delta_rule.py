"""The gated delta rule in Triton, recurrent and chunked (``ref/linear_attention.py``).

Both kernels give one program one (sequence, value head) and a ``BV``-wide slice of the value
dim: the delta rule's columns of v are independent given k, so the (Dk, BV) slice of the state
lives in registers for the whole sequence. Everything is float32; the state in and out too.

The chunked kernel follows the reference's UT form per chunk of ``CHUNK`` tokens; the unit
lower-triangular system (I + A) u = rhs is solved by forward substitution, one row at a time,
on the chunk held in registers. Rows past the sequence end are zero (k = v = beta = g = 0),
so they neither move the state nor its decay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentx.errors import ConfigError

_BV = 32


@triton.jit
def _load_step_inputs(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, t, ok, dk, vi, dk_ok, vi_ok, hk, h,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                      stride_gt):  # fmt: skip
    """Rows ``t`` (a vector, masked by ``ok``) of q, k (.., Dk), v (.., BV), g, beta."""
    tt = t.to(tl.int64)[:, None]
    q = tl.load(q_ptr + tt * stride_qt + hk * stride_qh + dk[None, :],
                mask=ok[:, None] & dk_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
    k = tl.load(k_ptr + tt * stride_kt + hk * stride_kh + dk[None, :],
                mask=ok[:, None] & dk_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
    v = tl.load(v_ptr + tt * stride_vt + h * stride_vh + vi[None, :],
                mask=ok[:, None] & vi_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
    g = tl.load(g_ptr + t * stride_gt + h, mask=ok, other=0.0).to(tl.float32)
    beta = tl.load(b_ptr + t * stride_gt + h, mask=ok, other=0.0).to(tl.float32)
    return q, k, v, g, beta


@triton.jit
def _delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s0_ptr, out_ptr, s_out_ptr,
    num_tokens, num_heads, scale,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_gb, stride_gt, stride_ob, stride_ot, stride_oh,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr,
    BV: tl.constexpr, CHUNK: tl.constexpr, HAS_STATE: tl.constexpr, CHUNKED: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b = (bh // num_heads).to(tl.int64)
    h = bh % num_heads
    hk = h // GROUP
    dk = tl.arange(0, DK_PAD)
    vi = tl.program_id(1) * BV + tl.arange(0, BV)
    dk_ok = dk < DK
    vi_ok = vi < DV
    state_off = bh.to(tl.int64) * DK * DV + dk[:, None] * DV + vi[None, :]
    state_mask = dk_ok[:, None] & vi_ok[None, :]
    if HAS_STATE:
        state = tl.load(s0_ptr + state_off, mask=state_mask, other=0.0)  # (DK_PAD, BV)
    else:
        state = tl.zeros([DK_PAD, BV], tl.float32)
    q_ptr += b * stride_qb
    k_ptr += b * stride_kb
    v_ptr += b * stride_vb
    out_ptr += b * stride_ob
    g_ptr += b * stride_gb
    b_ptr += b * stride_gb
    r = tl.arange(0, CHUNK)
    for c0 in range(0, num_tokens, CHUNK):
        t = c0 + r
        ok = t < num_tokens
        q, k, v, g, beta = _load_step_inputs(
            q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, t, ok, dk, vi, dk_ok, vi_ok, hk, h,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
        )  # fmt: skip
        q = q * scale
        if CHUNKED:
            out, state = _chunk(q, k, v, g, beta, state, r, CHUNK)
        else:
            out, state = _recurrent(q, k, v, g, beta, state, r, tl.minimum(CHUNK, num_tokens - c0))
        dst = out_ptr + t.to(tl.int64)[:, None] * stride_ot + h * stride_oh + vi[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=ok[:, None] & vi_ok[None, :])
    tl.store(s_out_ptr + state_off, state, mask=state_mask)


@triton.jit
def _row(x, r, i):
    """Row i of a register tile whose rows are indexed by r."""
    return tl.sum(tl.where(r[:, None] == i, x, 0.0), 0)


@triton.jit
def _recurrent(q, k, v, g, beta, state, r, num_rows):
    """A token at a time over the tile's first ``num_rows`` rows."""
    out = tl.zeros_like(v)
    for i in range(num_rows):
        k_i = _row(k, r, i)
        g_i = tl.sum(tl.where(r == i, g, 0.0), 0)
        b_i = tl.sum(tl.where(r == i, beta, 0.0), 0)
        state = state * tl.exp(g_i)
        predicted = tl.sum(k_i[:, None] * state, 0)  # (BV,)
        delta = (_row(v, r, i) - predicted) * b_i
        state = state + k_i[:, None] * delta[None, :]
        o_i = tl.sum(_row(q, r, i)[:, None] * state, 0)
        out = tl.where(r[:, None] == i, o_i[None, :], out)
    return out, state


@triton.jit
def _chunk(q, k, v, g, beta, state, r, CHUNK: tl.constexpr):
    """One chunk in UT form (see ``ref/linear_attention.py``: ``_chunk_step``)."""
    cum = tl.cumsum(g, 0)  # (C,): G_i
    lower = r[:, None] >= r[None, :]
    decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], float("-inf")))  # (C, C)
    kk = tl.dot(k, tl.trans(k), input_precision="ieee")
    a = tl.where(r[:, None] > r[None, :], beta[:, None] * kk * decay, 0.0)
    k_state = tl.dot(k, state, input_precision="ieee")  # (C, BV)
    rhs = beta[:, None] * (v - tl.exp(cum)[:, None] * k_state)
    u = tl.zeros_like(rhs)
    for i in range(CHUNK):  # forward substitution: u_i = rhs_i - sum_(j<i) A_ij u_j
        u_i = _row(rhs, r, i) - tl.sum(_row(a, r, i)[:, None] * u, 0)
        u = tl.where(r[:, None] == i, u_i[None, :], u)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
    out = tl.dot(q * tl.exp(cum)[:, None], state, input_precision="ieee")
    out += tl.dot(scores, u, input_precision="ieee")
    last = tl.sum(tl.where(r == CHUNK - 1, cum, 0.0), 0)  # zero rows past the end keep G
    k_to_end = k * tl.exp(last - cum)[:, None]
    state = state * tl.exp(last) + tl.dot(tl.trans(k_to_end), u, input_precision="ieee")
    return out, state


def _run(q, k, v, g, beta, initial_state, scale, chunk_size, chunked):
    batch, num_tokens, num_k_heads, dk = q.shape
    num_heads, dv = v.shape[2], v.shape[3]
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    if g.stride() != beta.stride():
        g, beta = g.contiguous(), beta.contiguous()
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    state = torch.empty(batch, num_heads, dk, dv, dtype=torch.float32, device=v.device)
    s0 = state if initial_state is None else initial_state.float().contiguous()
    bv = min(_BV, triton.next_power_of_2(dv))
    grid = (batch * num_heads, triton.cdiv(dv, bv))
    _delta_rule_kernel[grid](
        q, k, v, g, beta, s0, out, state, num_tokens, num_heads, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        GROUP=num_heads // num_k_heads, DK=dk, DV=dv,
        DK_PAD=max(16, triton.next_power_of_2(dk)), BV=bv, CHUNK=chunk_size,
        HAS_STATE=initial_state is not None, CHUNKED=chunked,
    )  # fmt: skip
    return out, state


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``ref/linear_attention.py``: a token at a time (tiles of 16 rows loaded at once)."""
    return _run(q, k, v, g, beta, initial_state, scale, 16, chunked=False)


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``ref/linear_attention.py``; ``chunk_size`` must be a power of two >= 16."""
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ConfigError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    return _run(q, k, v, g, beta, initial_state, scale, chunk_size, chunked=True)
