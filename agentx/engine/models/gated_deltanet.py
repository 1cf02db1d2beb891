"""The Gated DeltaNet token mixer (Qwen3-Next's linear-attention layers), with paged state.

    x -> in_proj_qkvz -> q, k, v, z        in_proj_ba -> b, a
         [q | k | v] -> causal depthwise conv (carried state) -> silu -> q, k, v
         q, k -> l2 norm;  beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
         gated delta rule (carried recurrent state) -> RMSNorm(o) * silu(z) -> out_proj

Per layer the cache is two page tensors: conv state (pages, conv_dim, K-1) and recurrent state
(pages, H_v, D_k, D_v). The forward context says where each request's state comes from and
which pages get the states reached at its save points; requests with one new token go through
one batched recurrent step, longer ones through the chunked rule, cut at their save points.
Knows nothing about how pages are allocated or retained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from agentx import kernels
from agentx.engine.models.blocks import RMSNorm
from agentx.engine.models.forward_context import LinearStateMetadata, get_forward_context
from agentx.engine.models.layers import ColumnParallelLinear, RowParallelLinear
from agentx.engine.parallel import ParallelState
from agentx.errors import ModelLoadError

if TYPE_CHECKING:
    from agentx.engine.models.qwen3_next import Qwen3NextConfig


class GroupedColumnLinear(ColumnParallelLinear):
    """A fused projection whose checkpoint interleaves its parts per key-head group:

    checkpoint rows  [ g0: p0 p1 p2 .. | g1: p0 p1 p2 .. | ... ]
    kept as          [ p0: g0 g1 .. | p1: g0 g1 .. | ... ]   (``output_sizes`` order)
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        num_groups: int,
        parallel: ParallelState,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(in_features, output_sizes, parallel, False, dtype)
        self.num_groups = num_groups
        self.group_sizes = [size // num_groups for size in output_sizes]

    def load(self, name: str, full: torch.Tensor, part: int = 0) -> None:
        in_features = full.shape[-1]
        grouped = full.view(self.num_groups, -1, in_features)  # (groups, rows per group, in)
        for i, rows in enumerate(grouped.split(self.group_sizes, dim=1)):
            super().load(name, rows.reshape(-1, in_features), i)  # (groups * rows, in)


class CausalConv1d(nn.Module):
    """Depthwise causal conv over time; weight (channels, kernel), no bias."""

    def __init__(self, channels: int, kernel_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(
            torch.empty(channels, kernel_size, dtype=dtype), requires_grad=False
        )

    def load(self, name: str, full: torch.Tensor, part: int = 0) -> None:
        self.weight.data.copy_(full.reshape(self.weight.shape))  # (C, 1, K) in checkpoints


class GatedRMSNorm(RMSNorm):
    """A plain-weight RMSNorm whose output is multiplied by silu(gate)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm_gated(x, gate, self.weight, self.eps)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """The one-token requests of a step, as index tensors for one batched recurrent step."""

    rows: torch.Tensor  # (B,) flat row of each request's token
    src_pages: torch.Tensor  # (B,) page holding its state, -1: zeros
    save_rows: torch.Tensor  # (S,) which of the B states goes to ...
    save_pages: torch.Tensor  # (S,) ... which page


@dataclass(frozen=True, slots=True)
class LinearStepPlan:
    decode: DecodePlan | None
    prefill_ids: list[int]  # requests with more than one new token, run one by one


class LinearStepPlanner:
    """Derives a step's plan from its metadata once; every linear layer of a model shares one
    (the metadata object is the same for all of them within a step)."""

    def __init__(self) -> None:
        self._meta: LinearStateMetadata | None = None
        self._plan: LinearStepPlan | None = None

    def get(self, meta: LinearStateMetadata) -> LinearStepPlan:
        if meta is not self._meta:
            self._meta, self._plan = meta, _plan(meta)
        return self._plan


def _plan(meta: LinearStateMetadata) -> LinearStepPlan:
    qsl = meta.query_start_loc
    lens = [qsl[i + 1] - qsl[i] for i in range(len(meta.src_pages))]
    decode_ids = [i for i, n in enumerate(lens) if n == 1]
    if not decode_ids:
        return LinearStepPlan(None, list(range(len(lens))))
    saves = [(j, page) for j, i in enumerate(decode_ids) for _, page in meta.save_points[i]]
    if any(n != 1 for i in decode_ids for n, _ in meta.save_points[i]):
        raise ValueError("a one-token request saves only the state after its token")
    save_rows, save_pages = zip(*saves, strict=True)
    decode = DecodePlan(
        rows=torch.tensor([qsl[i] for i in decode_ids]),
        src_pages=torch.tensor([meta.src_pages[i] for i in decode_ids]),
        save_rows=torch.tensor(save_rows),
        save_pages=torch.tensor(save_pages),
    )
    return LinearStepPlan(decode, [i for i, n in enumerate(lens) if n > 1])


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        config: Qwen3NextConfig,
        eps: float,
        layer_id: int,
        planner: LinearStepPlanner,
        parallel: ParallelState,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if parallel.tp_size != 1:
            raise ModelLoadError("Gated DeltaNet layers do not support tensor parallel yet")
        self.layer_id = layer_id
        self.planner = planner
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        key_dim = self.num_k_heads * self.head_k_dim
        value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * key_dim + value_dim
        groups = self.num_k_heads
        self.in_proj_qkvz = GroupedColumnLinear(
            hidden_size, [key_dim, key_dim, value_dim, value_dim], groups, parallel, dtype
        )
        self.in_proj_ba = GroupedColumnLinear(
            hidden_size, [self.num_v_heads, self.num_v_heads], groups, parallel, dtype
        )
        self.conv1d = CausalConv1d(self.conv_dim, config.linear_conv_kernel_dim, dtype)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, eps, dtype)
        self.out_proj = RowParallelLinear(value_dim, hidden_size, parallel, dtype)

    def load(self, name: str, full: torch.Tensor, part: int = 0) -> None:
        if name not in ("A_log", "dt_bias"):
            raise ModelLoadError(f"unexpected Gated DeltaNet tensor {name!r}")
        getattr(self, name).data.copy_(full)

    def get_state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Conv state (conv_dim, K-1) and recurrent state (H_v, D_k, D_v) of one sequence."""
        conv = (self.conv_dim, self.conv1d.kernel_size - 1)
        return conv, (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, hidden); positions are unused (the state carries the order)."""
        q, k, v, z = self.in_proj_qkvz(x).split(self.in_proj_qkvz.output_sizes, dim=-1)
        b, a = self.in_proj_ba(x).split(self.in_proj_ba.output_sizes, dim=-1)  # (T, H_v) each
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (T, H_v) log decay
        mixed = torch.cat((q, k, v), dim=-1)  # (T, conv_dim)
        o = self._mix(mixed, g, beta)  # (T, H_v, D_v)
        z = z.view(-1, self.num_v_heads, self.head_v_dim)  # (T, H_v, D_v)
        return self.out_proj(self.norm(o, z).flatten(1))

    def _mix(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """Conv and delta rule over the flat batch, state read from and saved to pages."""
        ctx = get_forward_context()
        pages = ctx.kv_caches[self.layer_id]  # (conv pages, recurrent pages)
        meta = ctx.linear_for(self.layer_id)
        plan = self.planner.get(meta)
        out = mixed.new_empty(mixed.shape[0], self.num_v_heads, self.head_v_dim)
        if plan.decode is not None:
            self._decode(mixed, g, beta, pages, plan.decode, out)
        for i in plan.prefill_ids:
            self._prefill(mixed, g, beta, pages, meta, i, out)
        return out

    def _split_heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output (B, T, conv_dim) -> l2-normed q, k (B, T, H_k, D_k), v (B, T, H_v, D_v)."""
        key_dim = self.num_k_heads * self.head_k_dim
        q, k, v = y.split([key_dim, key_dim, y.shape[-1] - 2 * key_dim], dim=-1)
        q = l2norm(q.unflatten(-1, (self.num_k_heads, self.head_k_dim)))  # (B, T, H_k, D_k)
        k = l2norm(k.unflatten(-1, (self.num_k_heads, self.head_k_dim)))
        return q, k, v.unflatten(-1, (self.num_v_heads, self.head_v_dim))  # (B, T, H_v, D_v)

    def _decode(self, mixed, g, beta, pages, plan: DecodePlan, out) -> None:
        """One new token per request, all requests in one recurrent step."""
        conv_pages, rec_pages = pages
        rows = plan.rows
        conv_state = _read_states(conv_pages, plan.src_pages)  # (B, conv_dim, K-1)
        rec_state = _read_states(rec_pages, plan.src_pages)  # (B, H_v, D_k, D_v)
        x = mixed[rows].unsqueeze(1)  # (B, 1, conv_dim)
        y, conv_state = kernels.causal_conv1d(x, self.conv1d.weight, conv_state)
        q, k, v = self._split_heads(y)
        o, rec_state = kernels.gated_delta_rule_recurrent(
            q, k, v, g[rows, None], beta[rows, None], rec_state, self.head_k_dim**-0.5
        )
        out[rows] = o[:, 0].to(out.dtype)
        conv_pages[plan.save_pages] = conv_state[plan.save_rows].to(conv_pages.dtype)
        rec_pages[plan.save_pages] = rec_state[plan.save_rows].to(rec_pages.dtype)

    def _prefill(self, mixed, g, beta, pages, meta: LinearStateMetadata, i: int, out) -> None:
        """One request's tokens, the recurrent state cut at each save point:

        new tokens  [0 ........ n1 ........ n2 ......... L]
        chunked     [ segment 0 )[ segment 1 )[ segment 2 )
        saved                   ^ page 1    ^ page 2     ^ running page
        """
        conv_pages, rec_pages = pages
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        src = torch.tensor([meta.src_pages[i]])
        conv_state, rec_state = _read_states(conv_pages, src), _read_states(rec_pages, src)
        x = mixed[start:end].unsqueeze(0)  # (1, L, conv_dim)
        kernel_size = self.conv1d.kernel_size
        window = kernels.conv_window(x, conv_state, kernel_size)  # (1, conv_dim, K-1+L)
        y, _ = kernels.causal_conv1d(x, self.conv1d.weight, conv_state)
        q, k, v = self._split_heads(y)  # (1, L, H, D)
        g, beta = g[start:end].unsqueeze(0), beta[start:end].unsqueeze(0)  # (1, L, H_v)
        done = 0
        for n, page in meta.save_points[i]:
            if n > done:
                o, rec_state = kernels.gated_delta_rule_chunked(
                    q[:, done:n],
                    k[:, done:n],
                    v[:, done:n],
                    g[:, done:n],
                    beta[:, done:n],
                    rec_state,
                    self.head_k_dim**-0.5,
                )
                out[start + done : start + n] = o[0].to(out.dtype)
                done = n
            conv_pages[page] = window[0, :, n : n + kernel_size - 1].to(conv_pages.dtype)
            rec_pages[page] = rec_state[0].to(rec_pages.dtype)
        assert done == end - start, "the last save point must cover every new token"


def _read_states(pages: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copies of pages[src] (B, *state), zeros where src is -1 (a fresh sequence)."""
    states = pages[src.clamp(min=0)]  # advanced indexing copies
    states[src < 0] = 0
    return states
