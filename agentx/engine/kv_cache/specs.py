"""Frozen descriptions of how one attention type lays out its KV cache.

A spec decides behaviour (how many blocks a request needs, which manager serves it); the
scheduler never branches on attention type. Layers that share a spec form one KV group.
Sliding-window and linear-attention specs arrive with the hybrid KV manager; each must keep
``page_size_bytes`` equal to the pool's so every group allocates from the same pool.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec(ABC):
    block_size: int  # tokens per block
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block takes in one layer (K and V)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize

    @abstractmethod
    def get_max_num_blocks(self, max_model_len: int) -> int:
        """Most blocks one request of ``max_model_len`` tokens can hold at once."""


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(KVCacheSpec):
    def get_max_num_blocks(self, max_model_len: int) -> int:
        return -(-max_model_len // self.block_size)


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers (by index) whose caches share one spec and one block table per request."""

    spec: KVCacheSpec
    layer_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """How the pool is split: its block count and the KV groups drawing from it."""

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size
