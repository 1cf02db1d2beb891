"""Linear-attention ops in plain PyTorch: the gated delta rule and the causal depthwise conv.

Gated delta rule (Gated DeltaNet), per value head, with a (Dk, Dv) state S:

    S_t = exp(g_t) S_(t-1)                          decay (g_t <= 0, log space)
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T    delta rule: write the correction only
    o_t = scale * S_t^T q_t

Two forms with one signature: ``gated_delta_rule_recurrent`` (a token at a time; what a decode
step runs) and ``gated_delta_rule_chunked`` (a chunk of tokens at a time through the UT transform;
what a prefill runs). Both take an initial state and return the final one, so a sequence can be
cut anywhere and continued. Grouped value heads: query/key head h serves value heads
h * G .. h * G + G - 1 (G = num_v_heads // num_k_heads). States are float32.

The conv is depthwise and causal over time; its state is the last ``K - 1`` inputs before the
new tokens, laid out (C, K - 1) like the conv weight's time axis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of x (B, T, C) with weight (C, K), continuing after ``state``
    (B, C, K-1), the inputs that came before x (None: zeros, a fresh sequence).

    Returns the output (B, T, C) and the state after x (B, C, K-1).
    """
    num_channels, kernel_size = weight.shape
    window = conv_window(x, state, kernel_size)  # (B, C, K-1+T)
    out = F.conv1d(window.to(weight.dtype), weight.unsqueeze(1), bias, groups=num_channels)
    if silu:
        out = F.silu(out)
    return out.transpose(1, 2).to(x.dtype), window[:, :, -(kernel_size - 1) :]  # (B, T, C)


def conv_window(x: torch.Tensor, state: torch.Tensor | None, kernel_size: int) -> torch.Tensor:
    """[state | x^T] along time: (B, C, K-1+T). Its columns n .. n+K-2 are the conv state after
    the first n tokens of x."""
    b, _, c = x.shape
    if state is None:
        state = x.new_zeros(b, c, kernel_size - 1)
    return torch.cat((state.to(x.dtype), x.transpose(1, 2)), dim=-1)


def _expand_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """(B, T, H*, D) inputs -> float32 (B, H, T, D), query/key heads repeated to the value heads;
    g and beta (B, T, H) -> (B, H, T)."""
    group = v.shape[2] // k.shape[2]
    q, k = (x.repeat_interleave(group, dim=2) for x in (q, k))
    return tuple(x.transpose(1, 2).float() for x in (q, k, v, g, beta))


def _initial_state(
    initial_state: torch.Tensor | None, q: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    if initial_state is not None:
        return initial_state.float().clone()
    b, h, _, dk = q.shape
    return torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=v.device)


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (B, T, Hk, Dk), v (B, T, H, Dv), g and beta (B, T, H), initial_state (B, H, Dk, Dv)
    or None -> output (B, T, H, Dv) in v's dtype, final state (B, H, Dk, Dv) float32."""
    qh, kh, vh, gh, bh = _expand_heads(q, k, v, g, beta)  # (B, H, T, D), (B, H, T)
    state = _initial_state(initial_state, qh, vh)  # (B, H, Dk, Dv)
    out = torch.empty_like(vh)
    for t in range(qh.shape[2]):
        state = state * gh[:, :, t].exp()[..., None, None]
        predicted = torch.einsum("bhk,bhkv->bhv", kh[:, :, t], state)
        delta = (vh[:, :, t] - predicted) * bh[:, :, t, None]  # (B, H, Dv)
        state = state + kh[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = torch.einsum("bhk,bhkv->bhv", qh[:, :, t] * scale, state)
    return out.transpose(1, 2).to(v.dtype), state


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
    """Same inputs and outputs as :func:`gated_delta_rule_recurrent`, a chunk at a time.

    Inside a chunk (positions i, j; G_i the cumulative log decay from the chunk start, S0 the
    state before it), the delta-rule writes u solve a unit lower-triangular system
        u_i + sum_(j<i) beta_i exp(G_i - G_j) (k_i . k_j) u_j = beta_i (v_i - exp(G_i) S0^T k_i)
    and then  o_i = scale (exp(G_i) S0^T q_i + sum_(j<=i) exp(G_i - G_j) (q_i . k_j) u_j),
    S_end = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j u_j^T.
    The last chunk may be shorter: nothing is padded.
    """
    qh, kh, vh, gh, bh = _expand_heads(q, k, v, g, beta)  # (B, H, T, D), (B, H, T)
    state = _initial_state(initial_state, qh, vh)  # (B, H, Dk, Dv)
    out = torch.empty_like(vh)
    num_tokens = qh.shape[2]
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        out[:, :, start:end], state = _chunk_step(
            qh[:, :, start:end] * scale,
            kh[:, :, start:end],
            vh[:, :, start:end],
            gh[:, :, start:end],
            bh[:, :, start:end],
            state,
        )
    return out.transpose(1, 2).to(v.dtype), state


def _chunk_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: q, k (B, H, C, Dk), v (B, H, C, Dv), g, beta (B, H, C), state (B, H, Dk, Dv)."""
    n = q.shape[2]
    cum = g.cumsum(-1)  # (B, H, C): G_i
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # (I + A) with A strictly lower: A_ij = beta_i exp(G_i - G_j) k_i . k_j
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1) + torch.eye(n, device=q.device)
    rhs = torch.cat((v * beta[..., None], k_beta * cum.exp()[..., None]), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u = solved[..., : v.shape[-1]] - solved[..., v.shape[-1] :] @ state  # (B, H, C, Dv)
    scores = q @ k.transpose(-1, -2) * decay  # (B, H, C, C), causal incl. the diagonal
    out = (q * cum.exp()[..., None]) @ state + scores @ u
    last = cum[..., -1:]  # (B, H, 1)
    k_to_end = k * (last - cum).exp()[..., None]
    state = state * last.exp()[..., None] + k_to_end.transpose(-1, -2) @ u
    return out, state
