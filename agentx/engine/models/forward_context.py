"""The forward context: attention metadata and KV caches for one model forward.

Model code stays ignorant of serving: an attention layer asks ``get_forward_context()`` for
what it needs. Contexts refuse to nest, so a forward can never read another step's metadata.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from agentx.engine.parallel.prefill_split import PrefillSplit


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Layout of one flat varlen batch of ``B`` requests and ``T`` tokens.

    tokens:   [ r0 q0..q(n0-1) | r1 q0..q(n1-1) | ... ]   query_start_loc = [0, n0, n0+n1, ...]
    request i attends to its first ``seq_lens[i]`` tokens (cached + new); its new tokens are the
    last ``query_lens[i]`` of them.
    """

    slot_mapping: torch.Tensor  # (T,) int64: flat KV slot of each new token
    query_start_loc: list[int]  # (B+1,)
    seq_lens: list[int]  # (B,)
    block_tables: torch.Tensor  # (B, max_blocks) int64, padded with the null block
    decode_ids: torch.Tensor  # indices of requests with one new token, batched together
    prefill_ids: list[int]  # the other requests, attended one by one
    # per token: its request's index and how many keys it sees (its position + 1); built once
    # a step for the kernels that read every row in place
    token_req: torch.Tensor | None = None  # (T,) int64
    token_len: torch.Tensor | None = None  # (T,) int64
    # A CUDA graph's step (runner/cuda_graph.py, Triton only): query_start_loc and seq_lens are
    # then int32 device tensors, and the kernel's grid is fixed by these instead of the lists.
    max_query_len: int | None = None
    num_splits: int | None = None

    def kernel_options(self) -> dict[str, int]:
        """Extra arguments for the attention kernel ({} for an ordinary step)."""
        if self.max_query_len is None:
            return {}
        options = {"max_query_len": self.max_query_len}
        if self.num_splits is not None:
            options["num_splits"] = self.num_splits
        return options

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


@dataclass(frozen=True, slots=True)
class LinearStateMetadata:
    """Where each request's recurrent state (linear attention, SSM) comes from and goes to.

    A linear layer's cache is a tuple of per-page state tensors (shapes from its
    ``LinearStateSpec``), one page per state. Request i reads its state before this step from
    page ``src_pages[i]`` (-1: start from zeros), runs its ``query_start_loc`` tokens and, for
    each ``(n, page)`` in ``save_points[i]`` (n ascending), writes the state reached after its
    first n new tokens into ``page``. The last save point is always ``(query_len, running page)``.
    """

    query_start_loc: list[int]  # (B+1,)
    src_pages: list[int]  # (B,)
    save_points: list[tuple[tuple[int, int], ...]]  # (B,)


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """One step's metadata, per KV group, and each layer's cache.

    ``kv_caches[layer]`` is, for attention layers, a (num_blocks, 2, block_size, num_kv_heads,
    head_dim) tensor; for linear layers a tuple of (num_blocks, *state_shape) tensors.
    """

    attn: tuple[AttentionMetadata | None, ...]  # per KV group (None for linear groups)
    layer_groups: tuple[int, ...]  # layer id -> KV group
    kv_caches: list[Any]
    linear: tuple[LinearStateMetadata | None, ...] = ()  # per KV group (None for attention)
    # prefill context parallel: this rank's rows of the step (None: every rank runs every row)
    pcp: PrefillSplit | None = None

    def attn_for(self, layer_id: int) -> AttentionMetadata:
        meta = self.attn[self.layer_groups[layer_id]]
        assert meta is not None, f"layer {layer_id} is not an attention layer"
        return meta

    def linear_for(self, layer_id: int) -> LinearStateMetadata:
        meta = self.linear[self.layer_groups[layer_id]]
        assert meta is not None, f"layer {layer_id} is not a linear-state layer"
        return meta


_local = threading.local()


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    if getattr(_local, "ctx", None) is not None:
        raise RuntimeError("forward contexts do not nest")
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = None


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError(
            "no forward context: attention runs only inside a model forward started by the runner"
        )
    return ctx
