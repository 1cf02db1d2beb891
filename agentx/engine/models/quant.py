"""Quantized weights: the checkpoint record and what a linear layer keeps after loading.

A GGUF checkpoint ships most matrices group-wise quantized (Q4_1, Q8_0). The loader hands those
to the model as :class:`QuantizedTensor` (the exact integers and per-group scales, no rounding),
and each linear layer decides once, in ``finalize_weights(mode)``, how to keep its weight:

    mode "auto"          quantized parts stay quantized (int4 / int8 kernels); float stays float
    mode "int8" / "int4" float weights are quantized too (Q8_0- / Q4_1-style, groups of 32)
    mode "none"          everything is dequantized to the model's float dtype

A layer is quantized only when every fused part arrived in one format and its shape tiles
(output features a multiple of 8, input features of 32); otherwise it keeps floats. The packed
layout and the math live in ``agentx.kernels`` (``ref/quant.py`` is their definition).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentx.kernels.ref.quant import GROUP, dequantize_weight, quantize_weight

__all__ = ["QuantizedTensor"]


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
