"""Llama (SmolLM2, Llama 3, Qwen2-style with qkv bias), built from the shared blocks.

token ids -> embed -> [ RMSNorm -> attention(RoPE, paged KV) -> + -> RMSNorm -> SwiGLU -> + ] x N
          -> RMSNorm -> lm_head (tied to embed when the checkpoint says so)
"""

from __future__ import annotations

import torch
from torch import nn

from agentx.engine.models.base import CausalLM
from agentx.engine.models.blocks import Attention, GatedMLP, RMSNorm
from agentx.engine.models.layers import RotaryEmbedding
from agentx.engine.models.spec import ModelSpec
from agentx.engine.parallel import ParallelState


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        layer_id: int,
        rotary: RotaryEmbedding,
        parallel: ParallelState,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.self_attn = Attention(spec, layer_id, rotary, parallel, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.mlp = GatedMLP(hidden, spec.intermediate_size, parallel, dtype, "silu")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    def __init__(
        self, spec: ModelSpec, parallel: ParallelState, dtype: torch.dtype = torch.float32
    ) -> None:
        rotary = RotaryEmbedding(
            spec.head_dim, spec.max_position, spec.rope_theta, spec.rope_scaling
        )
        super().__init__(
            spec,
            parallel,
            dtype,
            lambda i: LlamaDecoderLayer(spec, i, rotary, parallel, dtype),
        )
