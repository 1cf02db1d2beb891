"""Gemma 3 (text), built from the shared blocks.

token ids -> embed * sqrt(hidden)
          -> [ RMSNorm -> attention -> RMSNorm -> + -> RMSNorm -> GeGLU -> RMSNorm -> + ] x N
          -> RMSNorm -> lm_head (tied to embed)

attention: q, k -> per-head RMSNorm -> RoPE -> paged KV. ``spec.layer_types`` says which layers
are "sliding_attention" (a query sees the last ``spec.sliding_window`` tokens, RoPE base
``Gemma3Config.local_rope_theta``) and which "full_attention" (every token, RoPE base
``spec.rope_theta`` with ``spec.rope_scaling``); Gemma 3 makes every 6th layer full.

Gemma's RMSNorm scales by ``1 + weight``; checkpoints hold ``weight`` (Hugging Face naming), and
the offset is added once at load (``NormWeight.OFFSET_AT_LOAD``), so the forward pass is the
plain RMSNorm kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentx.engine.models.base import CausalLM
from agentx.engine.models.blocks import Attention, DecoderLayer, GatedMLP, NormWeight, RMSNorm
from agentx.engine.models.layers import RotaryEmbedding
from agentx.engine.models.spec import ModelSpec
from agentx.engine.parallel import ParallelState
from agentx.errors import ModelLoadError

GEMMA_NORM = NormWeight.OFFSET_AT_LOAD


@dataclass(frozen=True, slots=True)
class Gemma3Config:
    """What Gemma 3 needs beyond :class:`ModelSpec` (it travels in ``spec.arch_config``)."""

    query_pre_attn_scalar: float  # attention scores are scaled by query_pre_attn_scalar ** -0.5
    local_rope_theta: float = 10_000.0  # RoPE base of sliding layers


class Gemma3DecoderLayer(DecoderLayer):
    """Sandwich norms: each sublayer's input and output are normed, then added to the residual."""

    def __init__(
        self, spec: ModelSpec, dtype: torch.dtype, self_attn: Attention, mlp: GatedMLP
    ) -> None:
        super().__init__(spec, dtype, "self_attn", self_attn, mlp, GEMMA_NORM)
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype, GEMMA_NORM)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype, GEMMA_NORM)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp)


class Gemma3ForCausalLM(CausalLM):
    def __init__(
        self, spec: ModelSpec, parallel: ParallelState, dtype: torch.dtype = torch.float32
    ) -> None:
        if not isinstance(spec.arch_config, Gemma3Config):
            raise ModelLoadError("a Gemma 3 spec needs a Gemma3Config in spec.arch_config")
        local_rotary = RotaryEmbedding(
            spec.head_dim, spec.max_position, spec.arch_config.local_rope_theta, None
        )
        global_rotary = RotaryEmbedding(
            spec.head_dim, spec.max_position, spec.rope_theta, spec.rope_scaling
        )

        def make_layer(i: int) -> Gemma3DecoderLayer:
            sliding = spec.get_layer_type(i) == "sliding_attention"
            attn = Attention(
                spec,
                i,
                local_rotary if sliding else global_rotary,
                parallel,
                dtype,
                scale=spec.arch_config.query_pre_attn_scalar**-0.5,
                qk_norm=GEMMA_NORM,
                sliding_window=spec.sliding_window if sliding else None,
            )
            mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, parallel, dtype, "gelu_tanh")
            return Gemma3DecoderLayer(spec, dtype, attn, mlp)

        super().__init__(spec, parallel, dtype, make_layer, GEMMA_NORM)
        # sqrt(hidden) rounded to the weights' dtype (bf16: 25.25 for 25.30), as Hugging Face does
        embed_scale = torch.tensor(spec.hidden_size**0.5).to(dtype)
        self.register_buffer("embed_scale", embed_scale, persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale
