"""Expert dispatch under data-parallel attention (DEP): each rank arrives at a MoE layer with its
own requests' tokens only, and the experts are spread over the ranks (``expert_shard``).

Below the models, like ``prefill_split.py``: the MoE layer passes in its routing and a function
that computes this rank's experts' slots, and gets back every slot of its own tokens.

all_to_all (the default): a token travels once to each rank holding one of its k experts, with
its k weights and ids (the other ranks' ids set to -1); that rank computes its slots and sends
back only the filled ones::

    rank r:  x (T_r, D), ids (T_r, k)  ->  dest = ids // E_local           (T_r, k)
             counts per dest rank      --all_to_all-->  counts per source rank
             [x | weights | ids] rows by dest rank, then token  --all_to_all-->  (N, row bytes)
             slots (N, k, D) = this rank's experts on the received rows
             the filled slots, by source rank, token, slot  --all_to_all-->  (T_r * k, D)
    routed (T_r, D) = sum over each token's slots in expert order     moe_experts' float order

all_gather: every rank gathers every rank's rows (padded to the longest), computes its experts'
slots over all of them, one all-reduce fills every slot everywhere (each slot non-zero on one
rank: exact) and a rank keeps its own rows. Three collectives a layer either way (the row counts,
the rows, the slots); the all-gather moves every token to every rank and all-reduces ``world``
times the slots, the all-to-all only what each rank needs (benchmarks/dep_bench.py compares).

Why greedy tokens stay ep=1's: an expert sees the step's tokens routed to it (the same rows as at
ep=1, in another order: by source rank), each slot keeps its own value, and the source adds a
token's slots in ascending expert id as :func:`moe_experts` does. What may differ is the rest of
the layer stack on fewer rows (a rank's batch is its own requests): GEMMs that round with the
batch shape would show it (tests/engine/parallel/test_parallel_dep.py checks the tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# (x (N, D), weights (N, k), ids (N, k)) -> (N, k, D): the slots of the experts this rank holds,
# zeros elsewhere (kernels.moe_expert_slots bound to this rank's weights)
LocalSlots = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = ["LocalSlots", "dispatch_all_gather", "dispatch_all_to_all"]


def dispatch_all_to_all(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_local: int,
    local_slots: LocalSlots,
    group: Any = None,
) -> torch.Tensor:
    """This rank's tokens x (T, D) with routing (T, k) -> their slots (T, k, D), each computed
    on the rank holding its expert (``num_local`` experts a rank, contiguous)."""
    world = dist.get_world_size(group)
    num_tokens, top_k = ids.shape
    dest = ids // num_local  # (T, k)
    sends = torch.zeros(num_tokens, world, dtype=torch.bool)
    sends[torch.arange(num_tokens).unsqueeze(1), dest] = True  # (T, world)
    dest_rank, token = sends.t().nonzero(as_tuple=True)  # by dest rank, then token
    send_counts = sends.sum(0)  # (world,)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sent_ids = torch.where(dest[token] == dest_rank.unsqueeze(1), ids[token], -1)  # (S, k)
    payload = _pack(x[token], weights[token], sent_ids)  # (S, row bytes)
    received = payload.new_empty(int(recv_counts.sum()), payload.shape[1])
    recv_sizes, send_sizes = recv_counts.tolist(), send_counts.tolist()
    dist.all_to_all_single(received, payload, recv_sizes, send_sizes, group=group)
    rx, rw, rids = _unpack(received, x.dtype, x.shape[1], top_k)
    held = rids >= 0  # (N, k): exactly the slots of this rank's experts
    back = local_slots(rx, rw, rids)[held]  # (M, D): by source rank, token, slot
    back_sizes = [int(h.sum()) for h in held.split(recv_sizes)]
    ret_sizes = torch.bincount(dest.flatten(), minlength=world).tolist()
    returned = x.new_empty(num_tokens * top_k, x.shape[1])
    dist.all_to_all_single(returned, back.contiguous(), ret_sizes, back_sizes, group=group)
    slots = torch.empty_like(returned)  # (T*k, D): token t's j-th at t*k + j
    slots[dest.flatten().argsort(stable=True)] = returned  # the pairs by dest rank, then row-major
    return slots.view(num_tokens, top_k, x.shape[1])


def dispatch_all_gather(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    rank: int,
    local_slots: LocalSlots,
    group: Any = None,
) -> torch.Tensor:
    """As :func:`dispatch_all_to_all`, by gathering every rank's rows and all-reducing the
    slots."""
    world = dist.get_world_size(group)
    num_tokens, top_k = ids.shape
    sizes = [torch.empty(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([num_tokens]), group=group)
    longest = max(int(s) for s in sizes)
    pad = longest - num_tokens  # padding rows route nowhere (ids -1)
    payload = _pack(
        torch.cat([x, x.new_zeros(pad, x.shape[1])]),
        torch.cat([weights, weights.new_zeros(pad, top_k)]),
        torch.cat([ids, ids.new_full((pad, top_k), -1)]),
    )  # (longest, row bytes)
    parts = [torch.empty_like(payload) for _ in range(world)]
    dist.all_gather(parts, payload, group=group)
    gx, gw, gids = _unpack(torch.cat(parts), x.dtype, x.shape[1], top_k)
    slots = local_slots(gx, gw, gids)  # (world * longest, k, D)
    dist.all_reduce(slots, group=group)  # each slot non-zero on one rank: exact
    return slots[rank * longest : rank * longest + num_tokens]


def _pack(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One byte row per token, [x | weights | ids] (one collective, not three)."""
    parts = (x, weights.float(), ids.long())
    return torch.cat([p.contiguous().view(torch.uint8) for p in parts], dim=1)


def _unpack(
    rows: torch.Tensor, dtype: torch.dtype, hidden_size: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x_bytes = hidden_size * torch.empty(0, dtype=dtype).element_size()
    x_end, w_end = x_bytes, x_bytes + 4 * top_k
    x = rows[:, :x_end].contiguous().view(dtype)  # (N, D)
    weights = rows[:, x_end:w_end].contiguous().view(torch.float32)  # (N, k)
    ids = rows[:, w_end:].contiguous().view(torch.long)  # (N, k)
    return x, weights, ids
