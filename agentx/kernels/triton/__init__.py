"""The Triton backend (GPU): the same functions, with the same signatures, as ``kernels/ref``.

Each kernel is tested against the reference under ``TRITON_INTERPRET=1`` on CPU
(``tests/kernels/test_kernels_triton.py``); on a GPU ``benchmarks/gpu/check.sh`` runs the same tests
in
bfloat16. Importing this package imports ``triton``: the dispatch (``agentx.kernels``) imports
it only when the backend is chosen. Ops without a Triton kernel (MoE, quantized linear, the conv
window) stay with the reference.
"""

from agentx.kernels.triton.activation import gelu_tanh_and_mul, silu_and_mul
from agentx.kernels.triton.attention import paged_attention, paged_attention_with_lse
from agentx.kernels.triton.cache import write_kv
from agentx.kernels.triton.conv import causal_conv1d
from agentx.kernels.triton.delta_rule import gated_delta_rule_chunked, gated_delta_rule_recurrent
from agentx.kernels.triton.norm import fused_add_rms_norm, rms_norm, rms_norm_gated
from agentx.kernels.triton.rotary import apply_rotary

__all__ = [
    "apply_rotary",
    "causal_conv1d",
    "fused_add_rms_norm",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gelu_tanh_and_mul",
    "paged_attention",
    "paged_attention_with_lse",
    "rms_norm",
    "rms_norm_gated",
    "silu_and_mul",
    "write_kv",
]
