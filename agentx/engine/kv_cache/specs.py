"""Frozen descriptions of how one attention type lays out its KV cache.

A spec decides behaviour (how many blocks a request needs, which manager serves it); the
scheduler never branches on attention type. Layers that share a spec form one KV group.
Every group allocates from the same pool, so each spec's ``page_size_bytes`` must fit the
pool's page (the layout pads smaller pages up to it).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec(ABC):
    block_size: int  # tokens per block (for linear state: tokens between checkpoint boundaries)
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    @abstractmethod
    def page_size_bytes(self) -> int:
        """Bytes one block takes in one layer."""

    @abstractmethod
    def get_max_num_blocks(self, max_model_len: int) -> int:
        """Most blocks one request of ``max_model_len`` tokens can hold at once."""


@dataclass(frozen=True, slots=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int

    @property
    def page_size_bytes(self) -> int:
        """K and V of ``block_size`` tokens."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.itemsize


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(AttentionSpec):
    def get_max_num_blocks(self, max_model_len: int) -> int:
        return -(-max_model_len // self.block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(AttentionSpec):
    """A query sees the last ``sliding_window`` positions (itself included)."""

    sliding_window: int

    def get_max_num_blocks(self, max_model_len: int) -> int:
        # the window may straddle one more block than it covers, plus the block being written
        window_blocks = -(-(self.sliding_window - 1) // self.block_size) + 1
        return min(window_blocks + 1, -(-max_model_len // self.block_size))


@dataclass(frozen=True, slots=True)
class LinearStateSpec(KVCacheSpec):
    """A fixed-size recurrent state per sequence (linear attention, SSM): one page per state.

    ``shapes`` are the state tensors of one layer (e.g. conv state, recurrent state); a page
    holds all of them. Pages are kept at block boundaries as checkpoints (retention decides
    which), plus the running state of each live request.
    """

    shapes: tuple[tuple[int, ...], ...]

    @property
    def page_size_bytes(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes) * self.itemsize

    def get_max_num_blocks(self, max_model_len: int) -> int:
        return 2  # the running state and the checkpoint being written


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
