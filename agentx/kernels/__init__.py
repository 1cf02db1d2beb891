"""Device ops behind one dispatch.

``ref`` (PyTorch, runs on CPU, ground truth) and, later, ``triton`` (GPU) export the same
functions with the same signatures. ``AGENTX_KERNELS=auto|ref|triton`` picks the backend once,
at import; ``auto`` means ref until a GPU backend exists for the op.
"""

from __future__ import annotations

from agentx import env
from agentx.errors import ConfigError
from agentx.kernels import ref as _ref

BACKEND = env.kernel_backend()
if BACKEND == "triton":
    raise ConfigError("AGENTX_KERNELS=triton: the Triton backend is not built yet; use auto or ref")

apply_rotary = _ref.apply_rotary
causal_conv1d = _ref.causal_conv1d
conv_window = _ref.conv_window
gated_delta_rule_chunked = _ref.gated_delta_rule_chunked
gated_delta_rule_recurrent = _ref.gated_delta_rule_recurrent
gelu_tanh_and_mul = _ref.gelu_tanh_and_mul
moe_experts = _ref.moe_experts
paged_attention = _ref.paged_attention
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
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gelu_tanh_and_mul",
    "moe_experts",
    "paged_attention",
    "rms_norm",
    "rms_norm_gated",
    "silu_and_mul",
    "topk_softmax",
    "write_kv",
]
