"""The PyTorch reference backend: runs anywhere, and defines what every kernel must compute."""

from agentx.kernels.ref.attention import paged_attention, write_kv
from agentx.kernels.ref.ops import apply_rotary, gelu_tanh_and_mul, rms_norm, silu_and_mul

__all__ = [
    "apply_rotary",
    "gelu_tanh_and_mul",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "write_kv",
]
