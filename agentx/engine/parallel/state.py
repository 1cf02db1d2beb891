"""Which rank this process is in its tensor-, decode-context- and expert-parallel groups, and
which heads and experts it owns.

Passed explicitly into model constructors (never a mutable global), so the same model code
runs at world size 1 and under tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from agentx.errors import ConfigError


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The attention heads one rank computes: query heads ``[q_start, q_start + num_q)`` and
    KV heads ``[kv_start, kv_start + num_kv)`` of the full model."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


@dataclass(frozen=True, slots=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None  # a torch.distributed ProcessGroup when tp_size > 1
    # decode context parallel: this rank holds the KV of positions p with p % dcp_size == dcp_rank
    dcp_rank: int = 0
    dcp_size: int = 1
    dcp_group: Any = None
    # prefill context parallel over the same ranks as dcp (1 or dcp_size): a long prefill's
    # rows are split over the dcp group (prefill_split.py), the KV layout stays DCP's
    pcp_size: int = 1
    # expert parallel: this rank holds the routed experts of expert_shard(); the rest replicated
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: Any = None
    # data-parallel attention over the ep ranks (DEP): each rank runs its own requests' rows,
    # MoE layers send tokens to their experts' ranks (moe_dispatch.py: "all_to_all" or
    # "all_gather")
    dp_attention: bool = False
    moe_dispatch: str = "all_to_all"

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if not 0 <= self.dcp_rank < self.dcp_size:
            raise ValueError(f"dcp_rank {self.dcp_rank} outside dcp_size {self.dcp_size}")
        if self.pcp_size not in (1, self.dcp_size):
            raise ValueError(f"pcp_size {self.pcp_size} must be 1 or dcp_size {self.dcp_size}")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank {self.ep_rank} outside ep_size {self.ep_size}")

    def head_shard(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        """This rank's heads. KV heads are split as evenly as they go (the first ranks take one
        more: SmolLM2's 3 KV heads over 2 ranks are 2 + 1), each with its whole GQA group of
        query heads, so a query head always finds its KV head on its own rank::

            9 q heads, 3 KV heads, tp=2:   rank 0  q 0-5  kv 0-1   |  rank 1  q 6-8  kv 2

        With fewer KV heads than ranks each KV head is replicated on tp / num_kv_heads ranks,
        which split its query heads. Raises ConfigError when the heads do not divide.
        """
        tp, rank = self.tp_size, self.tp_rank
        if num_heads % num_kv_heads:
            raise ConfigError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
        group = num_heads // num_kv_heads
        if num_kv_heads >= tp:
            base, extra = divmod(num_kv_heads, tp)
            num_kv = base + (rank < extra)
            kv_start = rank * base + min(rank, extra)
            return HeadShard(kv_start * group, num_kv * group, kv_start, num_kv)
        if tp % num_kv_heads or num_heads % tp:
            raise ConfigError(
                f"tp={tp} cannot replicate {num_kv_heads} KV heads ({num_heads} query heads)"
            )
        num_q = num_heads // tp
        return HeadShard(rank * num_q, num_q, rank // (tp // num_kv_heads), 1)

    def expert_shard(self, num_experts: int) -> tuple[int, int]:
        """(first expert, number of experts) this rank holds: a contiguous range, the same size
        on every rank::

            6 experts, ep=2:   rank 0  experts 0-2  |  rank 1  experts 3-5

        Raises ConfigError when ``ep_size`` does not divide ``num_experts``.
        """
        if num_experts % self.ep_size:
            raise ConfigError(f"ep={self.ep_size} does not divide {num_experts} experts")
        num_local = num_experts // self.ep_size
        return self.ep_rank * num_local, num_local

    def ep_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the expert-parallel group, in place."""
        if self.ep_size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.ep_group)
        return x

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def dcp_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(*shape) on every DCP rank -> (dcp_size, *shape), rank order."""
        if self.dcp_size == 1:
            return x.unsqueeze(0)
        parts = [torch.empty_like(x) for _ in range(self.dcp_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.dcp_group)
        return torch.stack(parts)


SINGLE = ParallelState()
