"""Device ops behind one dispatch.

``ref`` (PyTorch, runs on CPU, ground truth), ``cpu`` (compiled C++ for AVX2 / AVX-512 CPUs:
quantized linear layers, in-place paged attention and a fused decoder layer) and ``triton``
(GPU: attention, KV write, norms, RoPE, gated activations, gated delta rule, causal conv)
export the same functions with the same signatures.
``AGENTX_KERNELS=auto|ref|cpu|triton`` picks the backend, read once at import. ``auto`` uses
``cpu`` for the ops it has when it builds and loads here, Triton for CUDA tensors when CUDA and
``triton`` are present, else ``ref``; ``triton`` sends every op Triton has to it, whatever the
device (on CPU that runs only under ``TRITON_INTERPRET=1``), and turns the C++ kernels off.
Without CUDA (and not forced) Triton is never imported and the ops are the reference's own
functions, so CPU paths pay no dispatch.
The C++ library is built and loaded on the first call of one of its ops (or by
:func:`prepare`), not at import, so ``import agentx`` stays cheap. :func:`prepare` also logs,
once per process, which kernels serve the ops (:func:`get_active_kernels`); when the compiled
kernels were wanted but could not build or load, ``cpu/build.py`` says so loudly.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from agentx import env
from agentx.errors import ConfigError
from agentx.kernels import cpu as _cpu
from agentx.kernels import ref as _ref
from agentx.kernels.ref import quant as _ref_quant
from agentx.kernels.ref.kv_int8 import head_dim_of

BACKEND = env.kernel_backend()
_log = logging.getLogger(__name__)
_logged: list[bool] = []  # the active kernels were logged (once per process)


def _load_triton() -> ModuleType | None:
    """The Triton backend when it serves some tensors here, else None (never imported)."""
    if BACKEND == "triton":
        try:
            from agentx.kernels import triton as backend
        except ImportError as e:
            raise ConfigError(f"AGENTX_KERNELS=triton: triton does not import here ({e})") from e
        return backend
    if BACKEND != "auto" or not torch.cuda.is_available():
        return None
    if importlib.util.find_spec("triton") is None:
        return None
    from agentx.kernels import triton as backend

    return backend


_TRITON = _load_triton()


def triton_enabled() -> bool:
    """Whether the Triton kernels serve their ops (CUDA tensors, or all under ``triton``)."""
    return _TRITON is not None


def _pick(name: str) -> Callable:
    """The op ``name``: the reference's function itself without Triton, Triton's under
    ``triton``, else a function sending CUDA tensors to Triton and the rest to the reference."""
    ref_op = getattr(_ref, name)
    if _TRITON is None:
        return ref_op
    triton_op = getattr(_TRITON, name)
    if BACKEND == "triton":
        return triton_op

    def op(x: torch.Tensor, *args, **kwargs):
        return (triton_op if x.is_cuda else ref_op)(x, *args, **kwargs)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = ref_op.__doc__
    return op


def cpu_kernels_enabled() -> bool:
    """Whether the compiled CPU kernels serve their ops (builds them on the first call)."""
    if BACKEND in ("ref", "triton"):
        return False
    if _cpu.available():
        return True
    if BACKEND == "cpu":
        raise ConfigError("AGENTX_KERNELS=cpu: the compiled CPU kernels are unavailable here")
    return False


def prepare(cpu: bool = True) -> bool:
    """Build / load the compiled kernels now when ``cpu`` (the engine calls it at start; False
    for an engine on another device) and log the active kernels, once per process. True when
    the compiled CPU kernels serve their ops."""
    enabled = cpu and cpu_kernels_enabled()
    if not _logged:
        _logged.append(True)
        active = get_active_kernels(cpu)
        _log.info(
            "agentx kernels: backend %s%s, ISA %s, build %s",
            active.backend,
            f" (CUDA tensors: {active.cuda_backend})" if active.cuda_backend else "",
            active.isa or "none",
            active.build_dir or "none",
        )
    return enabled


@dataclass(frozen=True, slots=True)
class ActiveKernels:
    """Which kernels serve the ops in this process.

    backend       what CPU tensors' ops run on: ``cpu`` (the compiled kernels for the ops they
                  have, the reference for the rest), ``ref``, or ``triton`` (``AGENTX_KERNELS=
                  triton``: every op Triton has, whatever the device)
    cuda_backend  ``triton`` when Triton serves CUDA tensors, else None
    isa           the compiled kernels' instructions (``avx2`` / ``avx512``), None without them
    build_dir     where the compiled kernels were loaded from, None without them
    """

    backend: str
    cuda_backend: str | None
    isa: str | None
    build_dir: Path | None


def get_active_kernels(cpu: bool = True) -> ActiveKernels:
    """The kernels serving the ops now; ``cpu`` False: without asking for the compiled ones
    (nothing is built)."""
    compiled = cpu and cpu_kernels_enabled()
    if BACKEND == "triton":
        backend = "triton"
    else:
        backend = "cpu" if compiled else "ref"
    return ActiveKernels(
        backend=backend,
        cuda_backend="triton" if _TRITON is not None else None,
        isa=_cpu.get_isa() if compiled else None,
        build_dir=_cpu.get_build_dir() if compiled else None,
    )


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


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """(rows,) int64: ``logits.argmax(dim=-1)`` of (rows, vocab) logits, through the compiled
    kernel where it takes them (float32 on the CPU, kernels enabled)."""
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] > 0
        and cpu_kernels_enabled()
    ):
        return _cpu.argmax_rows(logits)
    return logits.argmax(dim=-1)


def cpu_attention_fits(kv_cache: torch.Tensor) -> bool:
    """Whether the compiled paged attention takes this cache (device, head size, block size)."""
    return (
        kv_cache.device.type == "cpu"
        and head_dim_of(kv_cache) in (64, 128, 256)
        and kv_cache.shape[2] <= 256
        and kv_cache.dtype in (torch.float32, torch.bfloat16, torch.int8)
        and cpu_kernels_enabled()
    )


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """See ``ref/attention.py``; CUDA caches go to Triton, those the compiled CPU kernel takes
    to it."""
    if _TRITON is not None and (BACKEND == "triton" or kv_cache.is_cuda):
        return _TRITON.paged_attention(q, kv_cache, *args, **kwargs)
    backend = _cpu if cpu_attention_fits(kv_cache) else _ref
    return backend.paged_attention(q, kv_cache, *args, **kwargs)


paged_attention_with_lse = _pick("paged_attention_with_lse")


# A whole pre-norm SwiGLU layer over quantized weights (compiled CPU kernels only: callers check
# cpu_kernels_enabled); see cpu/csrc/decoder_layer.cpp.
fused_decoder_layer = _cpu.fused_decoder_layer
fused_decoder_layers = _cpu.fused_decoder_layers
FusedLayerStack = _cpu.FusedLayerStack
FusedLayerWeights = _cpu.FusedLayerWeights
FusedLinear = _cpu.FusedLinear
pack_quantized_weight = _ref_quant.pack_weight
token_layout = _cpu.token_layout
apply_rotary = _pick("apply_rotary")
causal_conv1d = _pick("causal_conv1d")
conv_window = _ref.conv_window
fused_add_rms_norm = _pick("fused_add_rms_norm")
gated_delta_rule_chunked = _pick("gated_delta_rule_chunked")
gated_delta_rule_recurrent = _pick("gated_delta_rule_recurrent")
gelu_tanh_and_mul = _pick("gelu_tanh_and_mul")
merge_attention_parts = _ref.merge_attention_parts
moe_expert_slots = _ref.moe_expert_slots
moe_experts = _ref.moe_experts
paged_attention_partial = _ref.paged_attention_partial
rms_norm = _pick("rms_norm")
rms_norm_gated = _pick("rms_norm_gated")
silu_and_mul = _pick("silu_and_mul")
sum_expert_slots = _ref.sum_expert_slots
topk_softmax = _ref.topk_softmax
write_kv = _pick("write_kv")

__all__ = [
    "ActiveKernels",
    "BACKEND",
    "FusedLayerStack",
    "FusedLayerWeights",
    "FusedLinear",
    "apply_rotary",
    "argmax_rows",
    "causal_conv1d",
    "conv_window",
    "cpu_attention_fits",
    "cpu_kernels_enabled",
    "fused_add_rms_norm",
    "fused_decoder_layer",
    "fused_decoder_layers",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gelu_tanh_and_mul",
    "get_active_kernels",
    "merge_attention_parts",
    "moe_expert_slots",
    "moe_experts",
    "pack_quantized_weight",
    "paged_attention",
    "paged_attention_partial",
    "paged_attention_with_lse",
    "prepare",
    "quantized_linear",
    "rms_norm",
    "rms_norm_gated",
    "silu_and_mul",
    "sum_expert_slots",
    "token_layout",
    "topk_softmax",
    "triton_enabled",
    "write_kv",
]
