"""The PyTorch reference backend: runs anywhere, and defines what every kernel must compute."""

from agentx.kernels.ref.attention import paged_attention, paged_attention_with_lse, write_kv
from agentx.kernels.ref.attention_partial import merge_attention_parts, paged_attention_partial
from agentx.kernels.ref.linear_attention import (
    causal_conv1d,
    conv_window,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)
from agentx.kernels.ref.moe import moe_expert_slots, moe_experts, sum_expert_slots, topk_softmax
from agentx.kernels.ref.ops import (
    apply_rotary,
    fused_add_rms_norm,
    gelu_tanh_and_mul,
    rms_norm,
    rms_norm_gated,
    silu_and_mul,
)

__all__ = [
    "apply_rotary",
    "causal_conv1d",
    "conv_window",
    "fused_add_rms_norm",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gelu_tanh_and_mul",
    "merge_attention_parts",
    "moe_expert_slots",
    "moe_experts",
    "paged_attention",
    "paged_attention_partial",
    "paged_attention_with_lse",
    "rms_norm",
    "rms_norm_gated",
    "silu_and_mul",
    "sum_expert_slots",
    "topk_softmax",
    "write_kv",
]
