"""The fused decoder layer's weights as one named record (``csrc/decoder_layer.cpp``).

The C++ op takes them as two flat lists, ``Tensor[] weights`` and ``int[] bits``; the order of
:class:`FusedLayerWeights`' fields is that order, here and nowhere else (the C++ side walks the
same fields, ``layer_fields``, and ``torch.ops.agentx.fused_layer_fields()`` names them: a test
keeps the two equal)::

    weights  input_norm | qkv_proj (qweight, scale, mins) | o_proj (3) | post_attention_norm
             | gate_up_proj (3) | down_proj (3)
    bits     qkv_proj | o_proj | gate_up_proj | down_proj
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, get_type_hints

import torch

__all__ = ["FusedLayerWeights", "FusedLinear"]


class FusedLinear(NamedTuple):
    """One quantized projection: ``ref/quant.py``'s packed int4 / int8 weight (``bits`` 4 or 8;
    int8 ignores ``mins``), or a GGUF K-quant weight's blocks (``bits`` its GGML type id;
    ``scale`` and ``mins`` unused, any float32 tensors)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    mins: torch.Tensor
    bits: int


@dataclass(frozen=True, slots=True)
class FusedLayerWeights:
    """A pre-norm SwiGLU layer's weights: the two RMSNorm scales (float32, (hidden,)) and the
    four projections, in the order the layer runs them. ``packed`` holds the op's two lists,
    built once here rather than on every call."""

    input_norm: torch.Tensor
    qkv_proj: FusedLinear
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


def _weight_fields() -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(FusedLayerWeights) if f.init)
