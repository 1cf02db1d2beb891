"""Compiled CPU kernels (C++; AVX2, and AVX-512 VNNI where present): quantized linear layers,
paged attention read in place (decode and prefill rows alike) and a fused decoder layer.

Same signatures as the reference backend (``kernels/ref``), which is their ground truth; the
library builds on first use (``build.py``). Callers check :func:`available` first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from agentx.kernels.cpu.build import available, get_build_dir
from agentx.kernels.cpu.fused_layer import FusedLayerStack, FusedLayerWeights, FusedLinear
from agentx.kernels.ref.kquant import KQUANT_TYPES

__all__ = [
    "FusedLayerStack",
    "FusedLayerWeights",
    "FusedLinear",
    "argmax_rows",
    "attention_bf16_products",
    "available",
    "fused_decoder_layer",
    "fused_decoder_layers",
    "get_build_dir",
    "get_isa",
    "has_amx",
    "has_avx512",
    "isas",
    "paged_attention",
    "quantized_linear",
    "token_layout",
    "use_isa",
]

_ISAS = ("avx2", "avx512", "amx")


def get_isa() -> str:
    """The instructions the kernels use: "amx" (AVX-512 VNNI and AMX int8 tiles) or "avx512"
    (AVX-512 VNNI) where the CPU has them, else "avx2"."""
    return _ISAS[torch.ops.agentx.kernel_isa(-1)]


def isas() -> list[str]:
    """Every ISA level this CPU runs the kernels at, lowest first (tests compare them all)."""
    current = torch.ops.agentx.kernel_isa(-1)
    found = [isa for level, isa in enumerate(_ISAS) if torch.ops.agentx.kernel_isa(level) == level]
    torch.ops.agentx.kernel_isa(current)
    return found


def has_avx512() -> bool:
    """Whether this CPU runs the AVX-512 VNNI kernels."""
    return "avx512" in isas()


def attention_bf16_products() -> bool:
    """Whether the attention over a bf16 cache multiplies with VDPBF16PS at the current ISA
    (AVX-512 with AVX512_BF16; elsewhere two FMAs a pair, the same bits)."""
    return bool(torch.ops.agentx.attention_bf16_products())


def has_amx() -> bool:
    """Whether this CPU (and its OS) runs the AMX K-quant GEMM."""
    return "amx" in isas()


@contextlib.contextmanager
def use_isa(isa: str) -> Iterator[None]:
    """Run the kernels with ``isa`` ("avx2", "avx512" or "amx") inside the block (tests compare
    them; they give the same bits). Process-wide: not for use while an engine runs."""
    previous = torch.ops.agentx.kernel_isa(-1)
    if torch.ops.agentx.kernel_isa(_ISAS.index(isa)) != _ISAS.index(isa):
        raise ValueError(f"this CPU cannot run the {isa} kernels")
    try:
        yield
    finally:
        torch.ops.agentx.kernel_isa(previous)


def quantized_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None,
    bits: int,
) -> torch.Tensor:
    """x (M, K) float32 -> (M, N) float32 through the packed weight (see ``ref/quant.py``), or
    through a K-quant weight's blocks when ``bits`` is a GGML K-quant type (``ref/kquant.py``;
    scale and mins unused)."""
    if bits in KQUANT_TYPES:
        return torch.ops.agentx.kquant_linear(x, qweight, bits, bias)
    return torch.ops.agentx.quantized_linear(x, qweight, scale, mins, bias, bits)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    decode_ids: torch.Tensor,
    prefill_ids: list[int],
    scale: float,
    sliding_window: int | None = None,
    token_req: torch.Tensor | None = None,
    token_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference contract, every row (decode or prefill) read in place from the paged
    cache; ``token_req`` / ``token_len`` (see :func:`token_layout`) when the caller has them."""
    if token_req is None or token_len is None:
        token_req, token_len = token_layout(query_start_loc, seq_lens)
    out = torch.ops.agentx.paged_attention_rows(
        q.float(), kv_cache, block_tables, token_req, token_len, scale, sliding_window or 0
    )
    return out.to(q.dtype)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """(rows,) int64: each row's ``logits.argmax(dim=-1)`` (the first maximum, or the row's first
    NaN) of a (rows, vocab) float32 CPU tensor, on the kernels' team (csrc/argmax.cpp)."""
    return torch.ops.agentx.argmax_rows(logits.contiguous())


def token_layout(query_start_loc: list[int], seq_lens: list[int]) -> tuple[torch.Tensor, ...]:
    """Per query row: its request's index and how many keys it sees (its position + 1)."""
    query_lens = torch.tensor(query_start_loc[1:]) - torch.tensor(query_start_loc[:-1])
    token_req = torch.repeat_interleave(torch.arange(len(seq_lens)), query_lens)
    ends = torch.tensor(seq_lens, dtype=torch.long)
    # row j of request i (query rows qs..qe-1) sees seq_lens[i] - (qe - 1 - j) keys
    last_row = torch.tensor(query_start_loc[1:], dtype=torch.long) - 1
    rows = torch.arange(int(query_start_loc[-1]), dtype=torch.long)
    token_len = ends[token_req] - (last_row[token_req] - rows)
    return token_req, token_len


def fused_decoder_layer(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    weights: FusedLayerWeights,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    token_req: torch.Tensor,
    token_len: torch.Tensor,
    num_heads: int,
    eps: float,
    scale: float,
    sliding_window: int | None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """One pre-norm SwiGLU decoder layer over quantized weights (``csrc/decoder_layer.cpp``);
    ``weights`` go to the op as its two lists, in the record's field order. With ``keep``
    (rows of ``x``, ascending) it returns those rows' outputs alone: every row's K and V are
    written, attention and the MLP run for the kept rows (each as it would among all)."""
    tensors, bits = weights.packed
    return torch.ops.agentx.fused_decoder_layer(
        x.contiguous(),
        positions,
        cos_sin,
        tensors,
        bits,
        kv_cache,
        slot_mapping,
        block_tables,
        token_req,
        token_len,
        num_heads,
        eps,
        scale,
        sliding_window or 0,
        keep,
    )


def fused_decoder_layers(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    stack: FusedLayerStack,
    kv_caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    token_req: torch.Tensor,
    token_len: torch.Tensor,
    num_heads: int,
    eps: float,
    scale: float,
    sliding_window: int | None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fused_decoder_layer` for consecutive layers in one call, layer i with
    ``stack.layers[i]`` and ``kv_caches[i]`` and everything else shared; ``keep`` applies to the
    last. The same bits as calling them one by one, without the framework's work between."""
    if len(kv_caches) != len(stack.layers):
        raise ValueError(f"{len(stack.layers)} layers but {len(kv_caches)} KV caches")
    tensors, bits = stack.packed
    return torch.ops.agentx.fused_decoder_layers(
        x.contiguous(),
        positions,
        cos_sin,
        tensors,
        bits,
        list(kv_caches),
        slot_mapping,
        block_tables,
        token_req,
        token_len,
        num_heads,
        eps,
        scale,
        sliding_window or 0,
        keep,
    )
