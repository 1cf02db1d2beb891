"""Llama (SmolLM2, Llama 3, Qwen2-style with qkv bias), built from the shared blocks.

token ids -> embed -> [ RMSNorm -> attention(RoPE, paged KV) -> + -> RMSNorm -> SwiGLU -> + ] x N
          -> RMSNorm -> lm_head (tied to embed when the checkpoint says so)
"""

from __future__ import annotations

import torch

from agentx.engine.models.base import CausalLM
from agentx.engine.models.blocks import Attention, DecoderLayer, GatedMLP
from agentx.engine.models.layers import RotaryEmbedding
from agentx.engine.models.spec import ModelSpec
from agentx.engine.parallel import ParallelState


class LlamaForCausalLM(CausalLM):
    def __init__(
        self, spec: ModelSpec, parallel: ParallelState, dtype: torch.dtype = torch.float32
    ) -> None:
        rotary = RotaryEmbedding(
            spec.head_dim, spec.max_position, spec.rope_theta, spec.rope_scaling
        )

        def make_layer(i: int) -> DecoderLayer:
            attn = Attention(spec, i, rotary, parallel, dtype)
            mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, parallel, dtype, "silu")
            return DecoderLayer(spec, dtype, "self_attn", attn, mlp)

        super().__init__(spec, parallel, dtype, make_layer)
