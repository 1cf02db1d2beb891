"""A sparse mixture-of-experts MLP with a gated shared expert (Qwen2-MoE / Qwen3-Next style).

    x -> router -> softmax -> top-k (renormalized or not) -> sum_k w_k * expert_k(x)
      + sigmoid(shared_expert_gate(x)) * shared_expert(x)

Every expert is a SwiGLU MLP; the routed ones live stacked in two tensors so a kernel can run
them grouped. Tensor parallelism is not built for experts yet: the block is replicated.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from agentx import kernels
from agentx.engine.models.blocks import GatedMLP
from agentx.engine.parallel import ParallelState
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
    """The routed experts, stacked: w13 (E, 2I, D) = each expert's [gate | up], w2 (E, D, I)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        shape13 = (num_experts, 2 * intermediate_size, hidden_size)
        shape2 = (num_experts, hidden_size, intermediate_size)
        self.w13 = nn.Parameter(torch.empty(shape13, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(shape2, dtype=dtype), requires_grad=False)

    def load(self, name: str, full: torch.Tensor, part: int = 0) -> None:
        """Checkpoints name experts one by one (``{e}.gate_proj.weight``, ``{e}.up_proj.weight``,
        ``{e}.down_proj.weight``); transformers' in-memory layout stacks them already
        (``gate_up_proj`` (E, 2I, D), ``down_proj`` (E, D, I))."""
        if name in ("gate_up_proj", "down_proj"):
            (self.w13 if name == "gate_up_proj" else self.w2).data.copy_(full)
            return
        match = _EXPERT_NAME.fullmatch(name)
        if match is None:
            raise ModelLoadError(f"unexpected expert tensor {name!r}")
        expert, proj = int(match[1]), match[2]
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
        return kernels.moe_experts(x, self.w13, self.w2, topk_weights, topk_ids)


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
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, dtype)
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, parallel, dtype)
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, D) -> (T, D)."""
        weights, ids = kernels.topk_softmax(self.gate(x), self.top_k, self.norm_topk_prob)
        routed = self.experts(x, weights, ids)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared
