"""Loading a GGUF file (llama.cpp's format) into a :class:`Checkpoint`.

Owns the GGUF -> Hugging Face tensor naming, dequantization (every type ``gguf.quants`` knows),
undoing llama.cpp's Q/K row permutation, and reading a :class:`ModelSpec` from ``<arch>.*``
metadata. The tokenizer comes from :meth:`Tokenizer.from_gguf`. Knows nothing about models
beyond names and shapes.

Supported ``general.architecture`` values: ``llama`` and ``qwen2`` (a Llama with q/k/v biases),
both mapped to the ``llama`` model, and ``gemma3`` (norm weights stored as ``1 + weight``; the
layer pattern, local RoPE base and attention scale are llama.cpp's built-in Gemma 3 values).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from agentx.engine.models.gemma3 import Gemma3Config
from agentx.engine.models.loader import Checkpoint
from agentx.engine.models.loader.gguf_file import GGUFFile, GGUFTensor
from agentx.engine.models.quant import KQuantTensor, QuantizedTensor
from agentx.engine.models.spec import ModelSpec, RopeScaling
from agentx.engine.models.tokenizer import Tokenizer
from agentx.errors import ModelLoadError

__all__ = ["load_gguf", "read_gguf_spec"]


_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LLAMA_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma: a norm after attention and after the MLP too, so "ffn_norm" is the one before the MLP.
_GEMMA3_BLOCK_NAMES = {
    **_LLAMA_BLOCK_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass(frozen=True, slots=True)
class _GgufArchitecture:
    architecture: str  # ModelSpec.architecture
    # llama.cpp's converter reorders Q/K rows for architectures it runs with interleaved (GPT-J
    # style) rotary; Qwen2 and Gemma 3 run with NEOX rotary and keep the Hugging Face order.
    permuted_qk: bool
    block_names: Mapping[str, str]  # blk.{i}.<name> -> model.layers.{i}.<Hugging Face name>
    norm_offset: float = 0.0  # the file's norm weights are the Hugging Face ones + this


_ARCHITECTURES = {
    "llama": _GgufArchitecture("llama", permuted_qk=True, block_names=_LLAMA_BLOCK_NAMES),
    "qwen2": _GgufArchitecture("llama", permuted_qk=False, block_names=_LLAMA_BLOCK_NAMES),
    "gemma3": _GgufArchitecture(
        "gemma3", permuted_qk=False, block_names=_GEMMA3_BLOCK_NAMES, norm_offset=1.0
    ),
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3.x frequency factors; folded into spec.rope_scaling


def load_gguf(
    path: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    keep_quantized: bool = False,
) -> Checkpoint:
    """Read a GGUF file: spec, tokenizer, and every tensor dequantized to ``dtype``; with
    ``keep_quantized``, Q4_1 and Q8_0 matrices come back as exact :class:`QuantizedTensor` and
    Q4_K / Q6_K ones as :class:`KQuantTensor` (the file's blocks).

    Raises ModelLoadError for a file that is not GGUF, an architecture not in ``_ARCHITECTURES``,
    or a tensor or setting it cannot map.
    """
    path = Path(path)
    reader = _open(path)
    spec = read_gguf_spec(reader)
    tokenizer = Tokenizer.from_gguf(reader)
    spec = replace(
        spec,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
        add_bos_token=tokenizer.add_bos,
    )
    weights = _read_weights(reader, spec, dtype, keep_quantized)
    return Checkpoint(spec=spec, weights=weights, tokenizer=tokenizer, path=path)


def read_gguf_spec(reader: GGUFFile) -> ModelSpec:
    """The architecture from ``<arch>.*`` metadata and the tensor list (no special token ids:
    those belong to the tokenizer and are filled in by :func:`load_gguf`)."""
    name = _metadata(reader, "general.architecture")
    architecture = _ARCHITECTURES.get(name)
    if architecture is None:
        raise ModelLoadError(
            f"GGUF architecture {name!r} is not supported (supported: {', '.join(_ARCHITECTURES)})"
        )
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("GGUF file has no token_embd.weight")

    def meta(key: str, default: Any = None) -> Any:
        value = _metadata(reader, f"{name}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata {name}.{key} is missing")
        return value

    hidden_size = meta("embedding_length")
    num_heads = meta("attention.head_count")
    num_kv_heads = meta("attention.head_count_kv", num_heads)
    if not isinstance(num_kv_heads, int):
        raise ModelLoadError(f"per-layer {name}.attention.head_count_kv is not supported")
    head_dim = meta("attention.key_length", hidden_size // num_heads)
    if meta("rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError("partial rotary embeddings (rope.dimension_count) are not supported")
    rope_theta = float(meta("rope.freq_base", 10000.0))
    num_layers = meta("block_count")
    extra = _gemma3_fields(meta, num_layers, head_dim) if name == "gemma3" else {}
    return ModelSpec(
        architecture=architecture.architecture,
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),
        hidden_size=hidden_size,
        intermediate_size=meta("feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        max_position=meta("context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=_rope_scaling(reader, name, tensors.get(_ROPE_FREQS), head_dim, rope_theta),
        **extra,
    )


def _gemma3_fields(meta: Callable[..., Any], num_layers: int, head_dim: int) -> dict[str, Any]:
    """What a Gemma 3 GGUF leaves to the reader: llama.cpp hard-codes it, and so do we.

    Every 6th layer is full attention, the others slide; ``rope.freq_base`` is the full layers'
    RoPE base (sliding ones use 10000); queries are scaled by head_dim ** -0.5, except in the
    27B (62 layers), trained with (hidden / heads) ** -0.5.
    """
    scalar = meta("embedding_length") / meta("attention.head_count") if num_layers == 62 else None
    return {
        "layer_types": tuple(
            "full_attention" if i % 6 == 5 else "sliding_attention" for i in range(num_layers)
        ),
        "sliding_window": meta("attention.sliding_window"),
        "arch_config": Gemma3Config(query_pre_attn_scalar=float(scalar or head_dim)),
    }


def _read_weights(
    reader: GGUFFile, spec: ModelSpec, dtype: torch.dtype, keep_quantized: bool
) -> dict[str, torch.Tensor | QuantizedTensor | KQuantTensor]:
    architecture = _ARCHITECTURES[_metadata(reader, "general.architecture")]
    permuted_qk = architecture.permuted_qk
    weights: dict[str, torch.Tensor | QuantizedTensor | KQuantTensor] = {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        name = _hf_name(tensor.name, architecture.block_names)
        quantized = _read_quantized(tensor) if keep_quantized else None
        if quantized is not None:
            value = quantized
        else:
            value = _dequantize(tensor)
        if architecture.norm_offset and tensor.name.endswith("norm.weight"):
            value = value - architecture.norm_offset
        elif permuted_qk and ".q_proj." in name:
            value = _unpermute(value, spec.num_heads)
        elif permuted_qk and ".k_proj." in name:
            value = _unpermute(value, spec.num_kv_heads)
        weights[name] = value if quantized is not None else value.to(dtype)
    return weights


def mostly_file_backed(checkpoint: Checkpoint) -> bool:
    """Whether at least 90% of ``checkpoint``'s weight bytes are K-quant blocks, which
    ``load_gguf`` leaves as views of the mapped file (so a cached copy would not be faster)."""
    kept = total = 0
    for value in checkpoint.weights.values():
        if isinstance(value, KQuantTensor):
            size = value.data.numel()
            kept += size
        elif isinstance(value, QuantizedTensor):
            size = sum(t.numel() * t.element_size() for t in (value.q, value.scale, value.mins))
        else:
            size = value.numel() * value.element_size()
        total += size
    return total > 0 and kept >= 0.9 * total


# GGUF block layouts kept as they are: (bits, bytes a block of 32)
_KEPT_TYPES = {GGMLQuantizationType.Q4_1: (4, 20), GGMLQuantizationType.Q8_0: (8, 34)}
_KQUANT_TYPES = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)


def _read_quantized(tensor: GGUFTensor) -> QuantizedTensor | KQuantTensor | None:
    """Q4_1 (fp16 d, fp16 m, 16 bytes: element j low nibble, j + 16 high) and Q8_0 (fp16 d,
    32 int8) matrices as their integers and scales, exactly; Q4_K / Q6_K matrices as their
    blocks (one row of the matrix a row of bytes); None for any other type."""
    if tensor.tensor_type in _KQUANT_TYPES and len(tensor.shape) == 2:
        # a view of the file (mapped copy-on-write: nothing here writes it, and a write would
        # stay private): no copy, and pages are read as the kernels first touch them
        rows = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1)
        return KQuantTensor(torch.from_numpy(rows), int(tensor.tensor_type))
    kept = _KEPT_TYPES.get(tensor.tensor_type)
    if kept is None or len(tensor.shape) != 2:
        return None
    bits, block_bytes = kept
    rows = int(tensor.shape[1])
    blocks = np.asarray(tensor.data).reshape(rows, -1, block_bytes)  # (N, K/32, bytes)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if bits == 4:
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = blocks[..., 4:]
        q = np.concatenate((packed & 0x0F, packed >> 4), axis=-1)  # (N, K/32, 32)
    else:
        mins = np.zeros_like(scale)
        q = np.clip(blocks[..., 2:].view(np.int8), -127, 127)
    return QuantizedTensor(
        torch.from_numpy(np.ascontiguousarray(q).reshape(rows, -1)),
        torch.from_numpy(scale),
        torch.from_numpy(mins),
        bits,
    )


def _unpermute(
    value: torch.Tensor | QuantizedTensor | KQuantTensor, num_heads: int
) -> torch.Tensor | QuantizedTensor | KQuantTensor:
    if isinstance(value, QuantizedTensor | KQuantTensor):
        return value.map_rows(lambda rows: _unpermute_rows(rows, num_heads))
    return _unpermute_rows(value, num_heads)


def _hf_name(gguf_name: str, block_names: Mapping[str, str]) -> str:
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in block_names:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent")
    return f"model.layers.{match[1]}.{block_names[match[2]]}.{match[3]}"


def _dequantize(tensor: GGUFTensor) -> torch.Tensor:
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(f"GGUF tensor {tensor.name}: {exc}") from exc
    if np.may_share_memory(array, tensor.data):  # F32 comes back as a view of the mapped file
        array = array.copy()
    # GGUF lists dimensions fastest-varying first: [in, out] for a Hugging Face (out, in) matrix.
    array = array.reshape(tuple(int(n) for n in reversed(tensor.shape)))
    return torch.from_numpy(array)


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (a weight (out, in) or a bias (out,)).

    Within each head of ``head_dim`` rows, Hugging Face keeps the two rotary halves apart and
    llama.cpp interleaves them::

        HF:   x0 x1 .. x(d/2-1) | y0 y1 .. y(d/2-1)     rotate_half pairs row i with i + d/2
        GGUF: x0 y0 x1 y1 .. x(d/2-1) y(d/2-1)          pairs rows 2i and 2i+1
    """
    rows = weight.shape[0]
    rest = weight.shape[1:]
    half = rows // num_heads // 2
    # (H, d/2, 2, ...) -> (H, 2, d/2, ...)
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def _rope_scaling(
    reader: GGUFFile,
    name: str,
    rope_freqs: GGUFTensor | None,
    head_dim: int,
    rope_theta: float,
) -> RopeScaling | None:
    if rope_freqs is not None:
        original = _metadata(reader, f"{name}.rope.scaling.original_context_length", 8192)
        return _llama3_scaling(_dequantize(rope_freqs), head_dim, rope_theta, original)
    kind = _metadata(reader, f"{name}.rope.scaling.type")
    factor = _metadata(reader, f"{name}.rope.scaling.factor")
    if kind is None and _metadata(reader, f"{name}.rope.scale_linear") is not None:
        kind, factor = "linear", _metadata(reader, f"{name}.rope.scale_linear")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(factor))
    raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported (only linear and llama3)")


def _llama3_scaling(
    divisors: torch.Tensor, head_dim: int, rope_theta: float, original_max_position: int
) -> RopeScaling:
    """llama.cpp stores Llama 3 scaling as one frequency divisor per rotary pair instead of its
    parameters. Rebuild the parameters (factor = the largest divisor, the usual low/high frequency
    factors 1 and 4) and accept them only if they reproduce every stored divisor."""
    scaling = RopeScaling(
        kind="llama3",
        factor=float(divisors.max()),
        original_max_position=int(original_max_position),
    )
    expected = torch.tensor(_llama3_divisors(scaling, head_dim, rope_theta), dtype=torch.float32)
    if expected.shape != divisors.shape or not torch.allclose(expected, divisors, rtol=1e-4):
        raise ModelLoadError("rope_freqs.weight does not match Llama 3 rope scaling")
    return scaling


def _llama3_divisors(scaling: RopeScaling, head_dim: int, rope_theta: float) -> list[float]:
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    divisors = []
    for pair in range(head_dim // 2):
        wavelen = 2 * math.pi * rope_theta ** (2 * pair / head_dim)
        if wavelen < high_wavelen:
            divisors.append(1.0)
        elif wavelen > low_wavelen:
            divisors.append(scaling.factor)
        else:
            smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            divisors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return divisors


def _metadata(reader: GGUFFile, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None:
        return default
    value = field.contents()
    if field.types == [GGUFValueType.FLOAT32]:
        # The file holds float32; take the shortest decimal that round-trips (1e-05, not
        # 9.999999747378752e-06): the value the original config.json had.
        return float(str(np.float32(value)))
    return value


def _open(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file: {exc}") from exc
