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
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)  # (n, I) each
        y = F.linear(F.silu(gate) * up, w2[expert])  # (n, D)
        weight = topk_weights.flatten()[slots, None].to(y.dtype)
        out.index_add_(0, tokens, y * weight)
    return out
