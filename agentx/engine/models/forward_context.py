"""The forward context: attention metadata and KV caches for one model forward.

Model code stays ignorant of serving: an attention layer asks ``get_forward_context()`` for
what it needs. Contexts refuse to nest, so a forward can never read another step's metadata.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


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

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


@dataclass(frozen=True, slots=True)
class ForwardContext:
    attn: AttentionMetadata
    kv_caches: list[torch.Tensor]  # per layer: (2, num_blocks, block_size, num_kv_heads, head_dim)


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
