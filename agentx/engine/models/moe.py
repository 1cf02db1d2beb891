"""A sparse mixture-of-experts MLP with a gated shared expert (Qwen2-MoE / Qwen3-Next style).

    x -> router -> softmax -> top-k (renormalized or not) -> sum_k w_k * expert_k(x)
      + sigmoid(shared_expert_gate(x)) * shared_expert(x)

Every expert is a SwiGLU MLP; the routed ones live stacked in two tensors so a kernel can run
them grouped. Tensor parallelism is not built for experts yet.

Expert parallel (``parallel.ep_size`` > 1): each rank holds ``num_experts / ep`` routed experts
(a contiguous range); the router, the shared expert and every token are on every rank (the
attention before it is replicated, so is its output). Each rank computes its experts' weighted
outputs per routing slot, one all-reduce fills every slot on every rank, and every rank sums each
token's slots in ascending expert id::

    rank r:  x (T, D) -> router -> top-k ids, weights (T, k)     (the same on every rank)
             slots (T, k, D) = w * expert(x) where rank r holds the expert, else 0
    all-reduce(slots)                                             each slot non-zero on one rank
    routed (T, D) = sum over each token's slots in expert order   moe_experts' float order

No all-to-all: with activations replicated every rank already has every token, so dispatch is
local and one collective combines. Reducing (T, k, D) slots rather than (T, D) partial sums costs
k times the bytes but keeps ep=N bit for bit equal to ep=1 (a partial sum per rank would add the
experts in another order). An all-to-all pays off once tokens are sharded (data-parallel
attention): then each token travels only to the ranks of its k experts.

Data-parallel attention (``parallel.dp_attention``, DEP): a rank arrives with its own requests'
tokens only; its slots come back from the ranks of their experts (``parallel/moe_dispatch.py``)
and it sums them as above. A rank with no tokens in a step still serves the others' through
:meth:`SparseMoeBlock.forward_idle`, layer by layer in the same order.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from agentx import kernels
from agentx.engine.models.blocks import GatedMLP
from agentx.engine.parallel import ParallelState
from agentx.engine.parallel.moe_dispatch import dispatch_all_gather, dispatch_all_to_all
from agentx.errors import ModelLoadError


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every rank (routers, scalar gates)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )

    def load(self, name: str, full: torch.Tensor, part: int = 0) -> None:
        self.weight.data.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


_EXPERT_NAME = re.compile(r"(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class FusedExperts(nn.Module):
    """The routed experts this rank holds, stacked: w13 (E_local, 2I, D) = each expert's
    [gate | up], w2 (E_local, D, I); experts ``[expert_start, expert_start + E_local)`` of the
    model's (all of them at ep=1)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        parallel: ParallelState,
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.parallel = parallel
        self.expert_start, self.num_local = parallel.expert_shard(num_experts)
        shape13 = (self.num_local, 2 * intermediate_size, hidden_size)
        shape2 = (self.num_local, hidden_size, intermediate_size)
        self.w13 = nn.Parameter(torch.empty(shape13, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(shape2, dtype=dtype), requires_grad=False)

    def load(self, name: str, full: torch.Tensor, part: int = 0) -> None:
        """Checkpoints name experts one by one (``{e}.gate_proj.weight``, ``{e}.up_proj.weight``,
        ``{e}.down_proj.weight``); transformers' in-memory layout stacks them already
        (``gate_up_proj`` (E, 2I, D), ``down_proj`` (E, D, I)). Only this rank's experts are
        copied; the others' tensors are skipped."""
        if name in ("gate_up_proj", "down_proj"):
            mine = full.narrow(0, self.expert_start, self.num_local)
            (self.w13 if name == "gate_up_proj" else self.w2).data.copy_(mine)
            return
        match = _EXPERT_NAME.fullmatch(name)
        if match is None:
            raise ModelLoadError(f"unexpected expert tensor {name!r}")
        expert, proj = int(match[1]) - self.expert_start, match[2]
        if not 0 <= expert < self.num_local:
            return  # another rank's expert
        size = self.intermediate_size
        if proj == "down_proj":
            self.w2.data[expert].copy_(full)
        else:
            self.w13.data[expert].narrow(0, 0 if proj == "gate_proj" else size, size).copy_(full)

    @staticmethod
    def param_for(name: str) -> str:
        """The parameter a checkpoint tensor name fills."""
        return "w2" if name.endswith(("down_proj", "down_proj.weight")) else "w13"

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """x (T, D), routing (T, k) -> (T, D): the weighted sum of each token's experts."""
        parallel = self.parallel
        if parallel.ep_size == 1:
            return kernels.moe_experts(x, self.w13, self.w2, topk_weights, topk_ids)
        if not parallel.dp_attention:
            slots = self._local_slots(x, topk_weights, topk_ids)  # (T, k, D)
            parallel.ep_all_reduce(slots)
        elif parallel.moe_dispatch == "all_gather":
            slots = dispatch_all_gather(
                x, topk_weights, topk_ids, parallel.ep_rank, self._local_slots, parallel.ep_group
            )
        else:
            slots = dispatch_all_to_all(
                x, topk_weights, topk_ids, self.num_local, self._local_slots, parallel.ep_group
            )
        return kernels.sum_expert_slots(slots, topk_ids)

    def _local_slots(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """(T, k, D): the slots of this rank's experts, zeros elsewhere."""
        return kernels.moe_expert_slots(
            x, self.w13, self.w2, topk_weights, topk_ids, self.expert_start
        )


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        shared_intermediate_size: int,
        norm_topk_prob: bool,
        parallel: ParallelState,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if parallel.tp_size != 1:
            raise ModelLoadError("mixture-of-experts layers do not support tensor parallel yet")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = ReplicatedLinear(hidden_size, num_experts, dtype)  # the router
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, dtype, parallel)
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, parallel, dtype)
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, dtype)

    def forward_idle(self) -> None:
        """DEP, a step without tokens on this rank: serve the other ranks' tokens routed to
        this rank's experts (the layer's collectives, with no rows of its own)."""
        weight = self.gate.weight  # (E, D): the hidden states' dtype and width
        x = weight.new_zeros(0, weight.shape[1])
        ids = torch.zeros(0, self.top_k, dtype=torch.long, device=weight.device)
        self.experts(x, ids.float(), ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, D) -> (T, D)."""
        weights, ids = kernels.topk_softmax(self.gate(x), self.top_k, self.norm_topk_prob)
        routed = self.experts(x, weights, ids)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared
