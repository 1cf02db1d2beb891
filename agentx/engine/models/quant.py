"""Quantized weights: the checkpoint record and what a linear layer keeps after loading.

A GGUF checkpoint ships most matrices group-wise quantized (Q4_1, Q8_0) or in K-quant
super-blocks (Q4_K, Q6_K). The loader hands those to the model as :class:`QuantizedTensor` (the
exact integers and per-group scales, no rounding) or :class:`KQuantTensor` (the file's bytes),
and each linear layer decides once, in ``finalize_weights(mode)``, how to keep its weight:

    mode "auto"          quantized parts stay quantized (int4 / int8 / K-quant kernels); float
                         stays float
    mode "int8" / "int4" float weights are quantized too (Q8_0- / Q4_1-style, groups of 32)
    mode "none"          everything is dequantized to the model's float dtype

A layer keeps Q4_1 / Q8_0 only when every fused part arrived in that one format and its shape
tiles (output features a multiple of 8, input features of 32); K-quant parts need only whole
super-blocks along the input and may mix types (Q4_K q and k, Q6_K v: one kernel call a run of
parts of one type). Otherwise the layer keeps floats. The packed layouts and the math live in
``agentx.kernels`` (``ref/quant.py`` and ``ref/kquant.py`` are their definitions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentx.kernels.ref import kquant
from agentx.kernels.ref.quant import GROUP, dequantize_weight, quantize_weight

__all__ = ["KQuantTensor", "QuantizedTensor"]


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """A (N, K) matrix as w = scale * q + min per group of 32 along K.

    bits=4: q (N, K) uint8 in 0..15 (GGUF Q4_1); bits=8: q (N, K) int8 in -127..127, min zeros
    (GGUF Q8_0). scale and min are (N, K/32) float32.
    """

    q: torch.Tensor
    scale: torch.Tensor
    mins: torch.Tensor
    bits: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.q, self.scale, self.mins).to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        """Rows (dim 0), or whole groups of columns (dim 1)."""
        if dim == 0:
            return self.map_rows(lambda t: t.narrow(0, start, length))
        if start % GROUP or length % GROUP:
            raise ValueError(f"a quantized column slice must align to groups of {GROUP}")
        return QuantizedTensor(
            self.q.narrow(1, start, length),
            self.scale.narrow(1, start // GROUP, length // GROUP),
            self.mins.narrow(1, start // GROUP, length // GROUP),
            self.bits,
        )

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedTensor:
        """The same row operation (a permutation, a slice) applied to q, scale and min."""
        return QuantizedTensor(fn(self.q), fn(self.scale), fn(self.mins), self.bits)

    @staticmethod
    def cat(parts: list[QuantizedTensor]) -> QuantizedTensor:
        """Stack fused parts (q, k, v; gate, up) along the output rows."""
        return QuantizedTensor(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.mins for p in parts]),
            parts[0].bits,
        )

    @staticmethod
    def from_float(w: torch.Tensor, bits: int) -> QuantizedTensor:
        return QuantizedTensor(*quantize_weight(w, bits), bits)


@dataclass(frozen=True, slots=True)
class KQuantTensor:
    """A (N, K) matrix as GGUF K-quant super-blocks of 256 along K, kept as the file's bytes.

    data: (N, K/256 * block bytes) uint8; kind: the GGML type id (``kquant.Q4_K``,
    ``kquant.Q6_K``), also the layer's ``bits`` code for the kernels.
    """

    data: torch.Tensor
    kind: int

    @property
    def shape(self) -> torch.Size:
        row_blocks = self.data.shape[1] // kquant.block_bytes(self.kind)
        return torch.Size((self.data.shape[0], row_blocks * kquant.BLOCK))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return kquant.dequantize(self.data, self.kind).to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> KQuantTensor:
        """Rows (dim 0), or whole super-blocks of columns (dim 1)."""
        if dim == 0:
            return self.map_rows(lambda t: t.narrow(0, start, length))
        if start % kquant.BLOCK or length % kquant.BLOCK:
            raise ValueError(f"a K-quant column slice must align to blocks of {kquant.BLOCK}")
        size = kquant.block_bytes(self.kind)
        return KQuantTensor(
            self.data.narrow(1, start // kquant.BLOCK * size, length // kquant.BLOCK * size),
            self.kind,
        )

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> KQuantTensor:
        return KQuantTensor(fn(self.data), self.kind)

    @staticmethod
    def cat(parts: list[KQuantTensor]) -> KQuantTensor:
        """Stack fused parts of one kind along the output rows."""
        return KQuantTensor(torch.cat([p.data for p in parts]).contiguous(), parts[0].kind)
