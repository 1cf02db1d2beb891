"""The fused decoder layer's weights as one named record (``csrc/decoder_layer.cpp``).

The C++ op takes them as two flat lists, ``Tensor[] weights`` and ``int[] bits``; the order of
:class:`FusedLayerWeights`' fields is that order, here and nowhere else (the C++ side walks the
same fields, ``layer_fields``, and ``torch.ops.agentx.fused_layer_fields()`` names them: a test
keeps the two equal)::

    weights  input_norm | qkv_proj (qweight, scale, mins) | qkv_proj_1 (3) | qkv_proj_2 (3)
             | qkv_bias | o_proj (3) | post_attention_norm | gate_up_proj (3) | down_proj (3)
    bits     qkv_proj | qkv_proj_1 | qkv_proj_2 | o_proj | gate_up_proj | down_proj

The q | k | v columns come in up to three runs (a Q4_K_M file ships q and k as Q4_K and v as
Q6_K in some layers), each multiplied straight into its columns::

    qkv   | qkv_proj columns | qkv_proj_1 columns | qkv_proj_2 columns |  (+ qkv_bias)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, get_type_hints

import torch

__all__ = ["FusedLayerStack", "FusedLayerWeights", "FusedLinear"]

_NO_BITS = 0  # FusedLinear.bits of a run that is not there


class FusedLinear(NamedTuple):
    """One quantized projection: ``ref/quant.py``'s packed int4 / int8 weight (``bits`` 4 or 8;
    int8 ignores ``mins``), or a GGUF K-quant weight's blocks (``bits`` its GGML type id;
    ``scale`` and ``mins`` unused, any float32 tensors)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    mins: torch.Tensor
    bits: int

    @classmethod
    def absent(cls) -> FusedLinear:
        """No projection (``bits`` 0): the unused runs of ``qkv_proj``."""
        empty = torch.empty(0)
        return cls(torch.empty(0, dtype=torch.uint8), empty, empty, _NO_BITS)


@dataclass(frozen=True, slots=True)
class FusedLayerWeights:
    """A pre-norm SwiGLU layer's weights: the two RMSNorm scales (float32, (hidden,)) and the
    four projections, in the order the layer runs them. The q | k | v projection is
    ``qkv_proj``'s columns, then ``qkv_proj_1``'s and ``qkv_proj_2``'s (K-quant runs, or
    :meth:`FusedLinear.absent`), plus ``qkv_bias`` (float32 (q + 2 kv,), or empty: none) added
    after the matmul. ``packed`` holds the op's two lists, built once here rather than on every
    call. :meth:`with_qkv_runs` fills the runs from a list."""

    max_qkv_runs: ClassVar[int] = 3  # qkv_proj, qkv_proj_1, qkv_proj_2

    input_norm: torch.Tensor
    qkv_proj: FusedLinear
    qkv_proj_1: FusedLinear
    qkv_proj_2: FusedLinear
    qkv_bias: torch.Tensor
    o_proj: FusedLinear
    post_attention_norm: torch.Tensor
    gate_up_proj: FusedLinear
    down_proj: FusedLinear
    packed: tuple[list[torch.Tensor], list[int]] = dataclasses.field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        tensors: list[torch.Tensor] = []
        bits: list[int] = []
        for field in _weight_fields():
            value = getattr(self, field.name)
            if isinstance(value, FusedLinear):
                tensors += (value.qweight, value.scale, value.mins)
                bits.append(value.bits)
            else:
                tensors.append(value)
        object.__setattr__(self, "packed", (tensors, bits))

    @classmethod
    def with_qkv_runs(
        cls, qkv_runs: list[FusedLinear], qkv_bias: torch.Tensor | None, **fields
    ) -> FusedLayerWeights:
        """The record with q | k | v given as 1 to 3 runs of columns (the rest absent) and an
        optional bias; ``fields`` are the other fields by name."""
        if not 1 <= len(qkv_runs) <= cls.max_qkv_runs:
            raise ValueError(f"qkv_proj takes 1 to {cls.max_qkv_runs} runs, got {len(qkv_runs)}")
        runs = [*qkv_runs] + [FusedLinear.absent()] * (cls.max_qkv_runs - len(qkv_runs))
        bias = torch.empty(0) if qkv_bias is None else qkv_bias
        return cls(
            qkv_proj=runs[0], qkv_proj_1=runs[1], qkv_proj_2=runs[2], qkv_bias=bias, **fields
        )

    @classmethod
    def field_names(cls) -> list[str]:
        """Every packed entry's name in order ("input_norm", "qkv_proj.qweight", ...,
        "qkv_proj.bits"), as the C++ op's ``fused_layer_fields()`` lists them."""
        types = get_type_hints(cls)
        names: list[str] = []
        for field in _weight_fields():
            if types[field.name] is FusedLinear:
                names += [f"{field.name}.{part}" for part in FusedLinear._fields]
            else:
                names.append(field.name)
        return names


@dataclass(frozen=True, slots=True)
class FusedLayerStack:
    """Consecutive layers' weights for :func:`~agentx.kernels.cpu.fused_decoder_layers`:
    ``packed`` holds each layer's two lists one after the other, built once here."""

    layers: tuple[FusedLayerWeights, ...]
    packed: tuple[list[torch.Tensor], list[int]] = dataclasses.field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a stack takes at least one layer")
        tensors: list[torch.Tensor] = []
        bits: list[int] = []
        for layer in self.layers:
            tensors += layer.packed[0]
            bits += layer.packed[1]
        object.__setattr__(self, "packed", (tensors, bits))


def _weight_fields() -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(FusedLayerWeights) if f.init)
