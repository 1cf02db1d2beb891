"""Logprobs of sampled tokens and of prompt tokens, from the logits rows of a step.

Raw model logprobs: the log-softmax of the logits over the whole vocabulary, taken before
temperature, top-k / top-p and grammar masks change them (what eval harnesses score; vLLM's
default). Only requests that asked for them pay: a step where none did computes nothing here.
"""

from __future__ import annotations

import torch

from agentx.engine.outputs import RowLogprobs, ScheduledRequest, TokenLogprob


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """(N, V) logits -> (N, V) float32 logprobs."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(
    logprobs: torch.Tensor, token_ids: list[int], ks: list[int]
) -> list[TokenLogprob]:
    """(N, V) logprobs, one chosen token and one top-k size per row -> a record per row."""
    if not token_ids:
        return []
    targets = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, targets[:, None])  # (N, 1)
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    top_k = max(ks)
    top_values, top_ids = logprobs.topk(top_k, dim=-1) if top_k else (None, None)
    records = []
    for row, (token_id, k) in enumerate(zip(token_ids, ks, strict=True)):
        top: tuple[tuple[int, float], ...] = ()
        if k:
            ids, values = top_ids[row, :k].tolist(), top_values[row, :k].tolist()
            top = tuple(zip(ids, values, strict=True))
        records.append(TokenLogprob(token_id, float(chosen[row, 0]), ranks[row], top))
    return records


def sampled_logprobs(
    items: list[ScheduledRequest],
    logprobs: torch.Tensor | None,
    rows: list[int],
    token_ids: list[int],
) -> dict[str, list[RowLogprobs]]:
    """Per request that asked, one record per sampled row (its first, then its drafts').

    ``logprobs`` holds the rows ``rows`` of the step's sampled logits; a request with a grammar
    keeps its rows whole, since its budget may append another token than the sampled one.
    """
    if logprobs is None:
        return {}
    records = token_logprobs(
        logprobs, [token_ids[r] for r in rows], [items[r].sampling.logprobs for r in rows]
    )
    out: dict[str, list[RowLogprobs]] = {}
    for i, (row, record) in enumerate(zip(rows, records, strict=True)):
        item = items[row]
        full = logprobs[i].cpu() if item.sampling.structured is not None else None
        out.setdefault(item.request_id, []).append(RowLogprobs(record, full))
    return out


def prompt_logprobs(
    scheduled: list[ScheduledRequest], logits: torch.Tensor, prompt_rows: list[tuple[int, int]]
) -> dict[str, list[TokenLogprob]]:
    """Per request with prompt targets this step, the logprob records of its targets, in
    order. ``logits`` holds the prompt rows of the step, request after request."""
    if not prompt_rows:
        return {}
    targets, ks = [], []
    for index, count in prompt_rows:
        item = scheduled[index]
        targets.extend(item.prompt_targets[:count])
        ks.extend([item.sampling.prompt_logprobs] * count)
    records = token_logprobs(log_softmax(logits), targets, ks)
    out: dict[str, list[TokenLogprob]] = {}
    start = 0
    for index, count in prompt_rows:
        out[scheduled[index].request_id] = records[start : start + count]
        start += count
    return out
