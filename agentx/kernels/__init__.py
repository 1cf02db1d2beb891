"""Device ops behind one dispatch.

``ref`` (PyTorch, runs on CPU, ground truth), ``cpu`` (compiled C++ for AVX2 / AVX-512 CPUs:
quantized linear layers, in-place paged attention and a fused decoder layer) and, later,
``triton`` (GPU) export the same functions with the same signatures.
``AGENTX_KERNELS=auto|ref|cpu|triton`` picks the backend, read once at import; ``auto`` uses
``cpu`` for the ops it has when it builds and loads here, else ``ref``.
The C++ library is built and loaded on the first call of one of its ops (or by
:func:`prepare`), not at import, so ``import agentx`` stays cheap.
"""

from __future__ import annotations

import torch

from agentx import env
from agentx.errors import ConfigError
from agentx.kernels import cpu as _cpu
from agentx.kernels import ref as _ref
from agentx.kernels.ref import quant as _ref_quant

BACKEND = env.kernel_backend()
if BACKEND == "triton":
    raise ConfigError(
        "AGENTX_KERNELS=triton: the Triton backend is not built yet; use auto, cpu or ref"
    )


def cpu_kernels_enabled() -> bool:
    """Whether the compiled CPU kernels serve their ops (builds them on the first call)."""
    if BACKEND == "ref":
        return False
    if _cpu.available():
        return True
    if BACKEND == "cpu":
        raise ConfigError("AGENTX_KERNELS=cpu: the compiled CPU kernels are unavailable here")
    return False


def prepare() -> bool:
    """Build / load the compiled kernels now (the engine calls it at start)."""
    return cpu_kernels_enabled()


def quantized_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None,
    bits: int,
) -> torch.Tensor:
    """See ``ref/quant.py``: the compiled kernel when enabled, else the reference."""
    backend = _cpu if cpu_kernels_enabled() else _ref_quant
    return backend.quantized_linear(x, qweight, scale, mins, bias, bits)


def cpu_attention_fits(kv_cache: torch.Tensor) -> bool:
    """Whether the compiled paged attention takes this cache (device, head size, block size)."""
    return (
        kv_cache.device.type == "cpu"
        and kv_cache.shape[-1] in (64, 128, 256)
        and kv_cache.shape[2] <= 256
        and kv_cache.dtype in (torch.float32, torch.bfloat16)
        and cpu_kernels_enabled()
    )


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """See ``ref/attention.py``; caches the compiled kernel takes go to it."""
    backend = _cpu if cpu_attention_fits(kv_cache) else _ref
    return backend.paged_attention(q, kv_cache, *args, **kwargs)


def fused_decoder_layer(*args, **kwargs) -> torch.Tensor:
    """A whole pre-norm SwiGLU layer over quantized weights (compiled CPU kernels only:
    callers check :func:`cpu_kernels_enabled`); see ``cpu/csrc/decoder_layer.cpp``."""
    return _cpu.fused_decoder_layer(*args, **kwargs)


pack_quantized_weight = _ref_quant.pack_weight
token_layout = _cpu.token_layout
apply_rotary = _ref.apply_rotary
causal_conv1d = _ref.causal_conv1d
conv_window = _ref.conv_window
gated_delta_rule_chunked = _ref.gated_delta_rule_chunked
gated_delta_rule_recurrent = _ref.gated_delta_rule_recurrent
gelu_tanh_and_mul = _ref.gelu_tanh_and_mul
merge_attention_parts = _ref.merge_attention_parts
moe_experts = _ref.moe_experts
paged_attention_partial = _ref.paged_attention_partial
rms_norm = _ref.rms_norm
rms_norm_gated = _ref.rms_norm_gated
silu_and_mul = _ref.silu_and_mul
topk_softmax = _ref.topk_softmax
write_kv = _ref.write_kv

__all__ = [
    "BACKEND",
    "apply_rotary",
    "causal_conv1d",
    "conv_window",
    "cpu_attention_fits",
    "cpu_kernels_enabled",
    "fused_decoder_layer",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gelu_tanh_and_mul",
    "merge_attention_parts",
    "moe_experts",
    "pack_quantized_weight",
    "paged_attention",
    "paged_attention_partial",
    "prepare",
    "quantized_linear",
    "rms_norm",
    "rms_norm_gated",
    "silu_and_mul",
    "token_layout",
    "topk_softmax",
    "write_kv",
]
