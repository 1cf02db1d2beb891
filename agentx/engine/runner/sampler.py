"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seed.

Randomness is a pure function of (request seed, output index): the same request samples the
same tokens whether it runs alone, batched, or resumed after preemption.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentx import kernels
from agentx.engine.sampling import SamplingParams

_SEED_STRIDE = 1_000_003  # mixes the output index into the seed


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    indices: Sequence[int],
) -> list[int]:
    """logits (N, V) float32 -> one token id per row."""
    out = kernels.argmax_rows(logits).tolist()
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    for i in random_rows:
        p = params[i]
        probs = _probs(logits[i], p)
        gen = torch.Generator(device=logits.device)
        gen.manual_seed((seeds[i] * _SEED_STRIDE + indices[i]) & 0x7FFF_FFFF_FFFF_FFFF)
        # exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i
        noise = torch.empty_like(probs).exponential_(generator=gen)
        out[i] = int((probs / noise).argmax())
    return out


def _probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """(V,) logits -> (V,) probabilities after temperature, top-k and top-p."""
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)
