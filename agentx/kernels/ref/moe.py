"""Mixture-of-experts ops in plain PyTorch: top-k routing and the routed SwiGLU experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) logits -> float32 weights and int64 expert ids, both (T, top_k): the softmax over
    all experts, its top k, rescaled to sum to 1 when ``renormalize``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k weight_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's experts e = ids_k.

    x (T, D), w13 (E, 2I, D) with each expert's gate rows before its up rows, w2 (E, D, I),
    topk_weights and topk_ids (T, k) -> (T, D).
    """
    out = torch.zeros_like(x)
    flat_ids = topk_ids.flatten()  # (T*k,): token t's j-th expert at t*k + j
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    top_k = topk_ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start : start + count]
        start += count
        tokens = slots // top_k
        y = _expert_mlp(x[tokens], w13[expert], w2[expert])  # (n, D)
        weight = topk_weights.flatten()[slots, None].to(y.dtype)
        out.index_add_(0, tokens, y * weight)
    return out


def moe_expert_slots(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int,
) -> torch.Tensor:
    """Each routing slot's weighted expert output, for the experts one rank holds.

    w13 (E_local, 2I, D) and w2 (E_local, D, I) are experts ``[expert_start, expert_start +
    E_local)``; x (T, D), topk_weights and topk_ids (T, k) -> (T, k, D) where slot (t, j) is
    ``weight_tj * expert_{ids_tj}(x_t)`` when this rank holds expert ``ids_tj``, else zeros. An
    expert sees the same tokens in the same order as in :func:`moe_experts`, so its values are
    the same bits; summing the ranks' slots adds only zeros to each value (exact), and
    :func:`sum_expert_slots` then adds them up in :func:`moe_experts`' order.
    """
    num_tokens, top_k = topk_ids.shape
    num_local = w13.shape[0]
    out = x.new_zeros(num_tokens * top_k, x.shape[1])  # (T*k, D): token t's j-th at t*k + j
    local_ids = topk_ids.flatten() - expert_start
    held = ((local_ids >= 0) & (local_ids < num_local)).nonzero().squeeze(1)
    held = held[local_ids[held].argsort(stable=True)]  # by expert, then by slot
    counts = torch.bincount(local_ids[held], minlength=num_local).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = held[start : start + count]
        start += count
        tokens = slots // top_k
        y = _expert_mlp(x[tokens], w13[expert], w2[expert])  # (n, D)
        out[slots] = y * topk_weights.flatten()[slots, None].to(y.dtype)
    return out.view(num_tokens, top_k, x.shape[1])


def sum_expert_slots(slots: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """(T, k, D) slot outputs -> (T, D): each token's k slots added one at a time in ascending
    expert id, from zeros: the float order of :func:`moe_experts` (which adds expert by
    expert), so the result is bit for bit its result."""
    order = topk_ids.argsort(dim=1, stable=True)  # (T, k)
    ordered = slots.gather(1, order.unsqueeze(-1).expand_as(slots))
    out = torch.zeros_like(ordered[:, 0])
    for j in range(ordered.shape[1]):
        out.add_(ordered[:, j])
    return out


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU MLP: x (n, D), w13 (2I, D) gate rows then up rows, w2 (D, I)."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)  # (n, I) each
    return F.linear(F.silu(gate) * up, w2)
