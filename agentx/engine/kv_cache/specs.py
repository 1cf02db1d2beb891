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

from agentx.kernels.ref.kv_int8 import SCALE_BYTES as KV_INT8_SCALE_BYTES


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
    def row_size(self) -> int:
        """Elements of one (token, KV head) row in the cache: ``head_size``, plus for an int8
        cache the row's float32 scale in its last 4 bytes (see ``kernels/ref/kv_int8.py``)."""
        return self.head_size + (KV_INT8_SCALE_BYTES if self.dtype == torch.int8 else 0)

    @property
    def page_size_bytes(self) -> int:
        """K and V of ``block_size`` tokens."""
        return 2 * self.block_size * self.num_kv_heads * self.row_size * self.itemsize


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
        # the running state read and the one written past a block boundary; checkpoints
        # beyond these are left out when the pool has no room (KVCacheManager._fit)
        return 2


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers (by index) whose caches share one spec and one block table per request."""

    spec: KVCacheSpec
    layer_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """How the pool is split: its block count and the KV groups drawing from it.

    Groups have (at most) equally many layers; the layer at position j of every group lives in
    memory slot j, so block id b names page b of each slot and one pool serves all groups::

        slot 0: [ page 0 | page 1 | ... ]   layer g0[0], g1[0], g2[0] ...
        slot 1: [ page 0 | page 1 | ... ]   layer g0[1], g1[1], g2[1] ...

    ``page_size_bytes`` is the largest spec's page; smaller pages are padded up to it.
    """

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]
    page_size_bytes: int = 0

    def __post_init__(self) -> None:
        sizes = {g.spec.block_size for g in self.groups}
        if len(sizes) != 1:
            raise ValueError(f"KV groups must share one block size, got {sorted(sizes)}")
        if self.page_size_bytes and any(
            g.spec.page_size_bytes > self.page_size_bytes for g in self.groups
        ):
            raise ValueError("a KV group's page is larger than the pool's page")

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size

    @property
    def num_slots(self) -> int:
        return max(len(g.layer_ids) for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_ids) for g in self.groups)
