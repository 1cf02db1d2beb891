"""Plan and allocate a model's KV cache: one spec per layer, equal-size KV groups, one page.

Layers with equal specs form a type; each type is cut into groups of G layers, G the smallest
type's layer count (Gemma 3 270M: 3 global + 15 sliding layers -> 6 groups of 3; a Llama: one
group of all layers). Memory is G slot buffers of ``num_blocks`` pages; a group's layer at
position j views slot j with its spec's shape. Page sizes must match: the pool's page is the
largest spec's, and when a linear state page outgrows an attention block, the block size is
doubled until the attention page holds it (a state must fit one page), so padding stays small.

The slots start zeroed (a page never written reads as zeros, never as NaN garbage). On the CPU they
are anonymous memory maps: the kernel hands out zero pages as they are first written, so a 2 GiB
pool costs nothing at start (``torch.zeros`` would write every byte, seconds) and resident memory
grows with the blocks in use. They can ask for transparent huge pages (``CacheConfig.huge_pages``:
a decode step reads blocks scattered over the pool, which on 4 KiB pages miss the TLB). On a GPU,
``torch.zeros`` is one fast memset.
"""

from __future__ import annotations

import mmap
import warnings
from typing import Any

import torch

from agentx.config import CacheConfig
from agentx.engine.kv_cache import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheSpec,
    LinearStateSpec,
    SlidingWindowSpec,
)
from agentx.engine.models.spec import ModelSpec
from agentx.engine.parallel import SINGLE, ParallelState
from agentx.errors import ConfigError


def get_layer_specs(
    spec: ModelSpec,
    model: Any,
    block_size: int,
    dtype: torch.dtype,
    parallel: ParallelState = SINGLE,
) -> list[KVCacheSpec]:
    """One KV spec per layer, from the model's layer types (this rank's KV heads)."""
    types = [spec.get_layer_type(i) for i in range(spec.num_layers)]
    unknown = set(types) - {"full_attention", "sliding_attention", "linear_attention"}
    if unknown:
        raise ConfigError(f"unknown layer types {sorted(unknown)} in {spec.architecture}")
    num_kv_heads = parallel.head_shard(spec.num_heads, spec.num_kv_heads).num_kv
    linear = None
    if "linear_attention" in types:
        linear = LinearStateSpec(
            block_size, model.linear_state_dtype, tuple(model.get_linear_state_shapes())
        )
        if any(t != "linear_attention" for t in types):
            attn_page = FullAttentionSpec(block_size, dtype, num_kv_heads, spec.head_dim)
            while attn_page.page_size_bytes < linear.page_size_bytes:
                block_size *= 2
                attn_page = FullAttentionSpec(block_size, dtype, num_kv_heads, spec.head_dim)
            linear = LinearStateSpec(block_size, linear.dtype, linear.shapes)
    specs: list[KVCacheSpec] = []
    for kind in types:
        if kind == "linear_attention":
            assert linear is not None
            specs.append(linear)
        elif kind == "sliding_attention" and spec.sliding_window is not None:
            specs.append(
                SlidingWindowSpec(
                    block_size, dtype, num_kv_heads, spec.head_dim, spec.sliding_window
                )
            )
        else:
            specs.append(FullAttentionSpec(block_size, dtype, num_kv_heads, spec.head_dim))
    return specs


def plan_kv_layout(layer_specs: list[KVCacheSpec], cache: CacheConfig) -> KVCacheLayout:
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer_id, layer_spec in enumerate(layer_specs):
        by_spec.setdefault(layer_spec, []).append(layer_id)
    group_size = min(len(layers) for layers in by_spec.values())
    groups = tuple(
        KVCacheGroup(layer_spec, tuple(layers[i : i + group_size]))
        for layer_spec, layers in by_spec.items()
        for i in range(0, len(layers), group_size)
    )
    page_bytes = max(s.page_size_bytes for s in by_spec)
    num_blocks = cache.num_blocks
    if num_blocks is None:
        num_blocks = cache.kv_cache_bytes // (page_bytes * group_size)
    if num_blocks < 2:
        raise ConfigError(
            f"kv_cache_bytes={cache.kv_cache_bytes} holds fewer than 2 blocks of "
            f"{page_bytes * group_size} bytes"
        )
    return KVCacheLayout(num_blocks, groups, page_bytes)


def allocate_kv_caches(
    layout: KVCacheLayout, device: torch.device, huge_pages: bool = False
) -> tuple[list[torch.Tensor], list[Any]]:
    """The slot buffers, and each layer's cache as a view into its slot."""
    slots = [
        allocate_zeroed(layout.num_blocks, layout.page_size_bytes, device, huge_pages)
        for _ in range(layout.num_slots)
    ]
    caches: list[Any] = [None] * layout.num_layers
    for group in layout.groups:
        for j, layer_id in enumerate(group.layer_ids):
            caches[layer_id] = _view(slots[j], group.spec)
    return slots, caches


def allocate_zeroed(
    num_rows: int, row_bytes: int, device: torch.device, huge_pages: bool = False
) -> torch.Tensor:
    """A zeroed (num_rows, row_bytes) uint8 tensor; on the CPU backed lazily (see above), by
    transparent huge pages where ``huge_pages`` and the kernel allows them (else 4 KiB pages)."""
    if device.type != "cpu":
        return torch.zeros(num_rows, row_bytes, dtype=torch.uint8, device=device)
    # Private anonymous pages read as zero until written (POSIX); the tensor keeps the map alive.
    memory = mmap.mmap(-1, num_rows * row_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            memory.madvise(mmap.MADV_HUGEPAGE)
        except OSError as error:  # a kernel built without THP: EINVAL
            warnings.warn(
                f"CacheConfig.huge_pages: the kernel refused MADV_HUGEPAGE ({error}); "
                "the KV pool runs on 4 KiB pages",
                RuntimeWarning,
                stacklevel=2,
            )
    return torch.frombuffer(memory, dtype=torch.uint8).view(num_rows, row_bytes)


def _view(slot: torch.Tensor, spec: KVCacheSpec) -> Any:
    num_blocks = slot.shape[0]
    if isinstance(spec, AttentionSpec):
        page = slot[:, : spec.page_size_bytes].view(spec.dtype)
        return page.view(num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.row_size)
    assert isinstance(spec, LinearStateSpec)
    states, offset = [], 0
    for shape in spec.shapes:
        nbytes = spec.itemsize * int(torch.Size(shape).numel())
        state = slot[:, offset : offset + nbytes].view(spec.dtype)
        states.append(state.view(num_blocks, *shape))  # (num_blocks, *shape)
        offset += nbytes
    return tuple(states)
