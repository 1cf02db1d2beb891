"""Gemma 3 (text), built from parallel-aware layers.

token ids -> embed * sqrt(hidden)
          -> [ RMSNorm -> attention -> RMSNorm -> + -> RMSNorm -> GeGLU -> RMSNorm -> + ] x N
          -> RMSNorm -> lm_head (tied to embed)

attention: q, k -> per-head RMSNorm -> RoPE -> paged KV. ``spec.layer_types`` says which layers
are "sliding_attention" (a query sees the last ``spec.sliding_window`` tokens, RoPE base
``Gemma3Config.local_rope_theta``) and which "full_attention" (every token, RoPE base
``spec.rope_theta`` with ``spec.rope_scaling``); Gemma 3 makes every 6th layer full.

Gemma's RMSNorm scales by ``1 + weight``; checkpoints hold ``weight`` (Hugging Face naming), and
the offset is added once at load, so the forward pass is the plain RMSNorm kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from agentx import kernels
from agentx.engine.models.attention import PagedAttention
from agentx.engine.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from agentx.engine.models.llama import LlamaForCausalLM
from agentx.engine.models.spec import ModelSpec
from agentx.engine.parallel import ParallelState
from agentx.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class Gemma3Config:
    """What Gemma 3 needs beyond :class:`ModelSpec` (it travels in ``spec.arch_config``)."""

    query_pre_attn_scalar: float  # attention scores are scaled by query_pre_attn_scalar ** -0.5
    local_rope_theta: float = 10_000.0  # RoPE base of sliding layers


class GemmaRMSNorm(RMSNorm):
    """RMSNorm times ``1 + weight``: the stored parameter is ``1 + weight``, computed in fp32."""

    def load(self, name: str, full: torch.Tensor, part: int = 0) -> None:
        self.weight.data.copy_(1.0 + full.float())


class Gemma3Attention(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        layer_id: int,
        rotary: RotaryEmbedding,
        parallel: ParallelState,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        config: Gemma3Config = spec.arch_config
        tp = parallel.tp_size
        self.num_heads = spec.num_heads // tp
        self.num_kv_heads = max(1, spec.num_kv_heads // tp)
        self.head_dim = spec.head_dim
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = ColumnParallelLinear(
            spec.hidden_size, [q_size, kv_size, kv_size], parallel, spec.attention_bias, dtype
        )
        self.q_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps, dtype)
        self.o_proj = RowParallelLinear(q_size, spec.hidden_size, parallel, dtype)
        self.rotary = rotary
        sliding = spec.get_layer_type(layer_id) == "sliding_attention"
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            config.query_pre_attn_scalar**-0.5,
            layer_id,
            sliding_window=spec.sliding_window if sliding else None,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))  # (T, H, D)
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))  # (T, Hkv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v)  # (T, H, D)
        return self.o_proj(o.flatten(1))


class Gemma3MLP(nn.Module):
    def __init__(self, spec: ModelSpec, parallel: ParallelState, dtype: torch.dtype) -> None:
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            spec.hidden_size, [size, size], parallel, False, dtype
        )
        self.down_proj = RowParallelLinear(size, spec.hidden_size, parallel, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
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
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.self_attn = Gemma3Attention(spec, layer_id, rotary, parallel, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.mlp = Gemma3MLP(spec, parallel, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp)


class Gemma3ForCausalLM(nn.Module):
    def __init__(
        self, spec: ModelSpec, parallel: ParallelState, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        if not isinstance(spec.arch_config, Gemma3Config):
            raise ModelLoadError("a Gemma 3 spec needs a Gemma3Config in spec.arch_config")
        self.spec = spec
        self.embed_tokens = VocabParallelEmbedding(
            spec.vocab_size, spec.hidden_size, parallel, dtype
        )
        # sqrt(hidden) rounded to the weights' dtype (bf16: 25.25 for 25.30), as Hugging Face does
        embed_scale = torch.tensor(spec.hidden_size**0.5).to(dtype)
        self.register_buffer("embed_scale", embed_scale, persistent=False)
        local_rotary = RotaryEmbedding(
            spec.head_dim, spec.max_position, spec.arch_config.local_rope_theta, None
        )
        global_rotary = RotaryEmbedding(
            spec.head_dim, spec.max_position, spec.rope_theta, spec.rope_scaling
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(
                spec,
                i,
                local_rotary if spec.get_layer_type(i) == "sliding_attention" else global_rotary,
                parallel,
                dtype,
            )
            for i in range(spec.num_layers)
        )
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, parallel, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, hidden)."""
        x = self.embed_tokens(input_ids) * self.embed_scale
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)

    # Same checkpoint naming and fused q/k/v, gate/up parts as Llama: load the same way.
    compute_logits = LlamaForCausalLM.compute_logits
    load_weights = LlamaForCausalLM.load_weights
    _resolve = staticmethod(LlamaForCausalLM._resolve)
