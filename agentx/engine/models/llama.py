"""Llama (SmolLM2, Llama 3, Qwen2-style with qkv bias), built from parallel-aware layers.

token ids -> embed -> [ RMSNorm -> attention(RoPE, paged KV) -> + -> RMSNorm -> SwiGLU -> + ] x N
          -> RMSNorm -> lm_head (tied to embed when the checkpoint says so)
"""

from __future__ import annotations

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
from agentx.engine.models.spec import ModelSpec
from agentx.engine.parallel import ParallelState
from agentx.errors import ModelLoadError


class LlamaAttention(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        layer_id: int,
        rotary: RotaryEmbedding,
        parallel: ParallelState,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        tp = parallel.tp_size
        self.num_heads = spec.num_heads // tp
        self.num_kv_heads = max(1, spec.num_kv_heads // tp)
        self.head_dim = spec.head_dim
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = ColumnParallelLinear(
            spec.hidden_size, [q_size, kv_size, kv_size], parallel, spec.attention_bias, dtype
        )
        self.o_proj = RowParallelLinear(q_size, spec.hidden_size, parallel, dtype)
        self.rotary = rotary
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, layer_id
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v)  # (T, H, D)
        return self.o_proj(o.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, parallel: ParallelState, dtype: torch.dtype) -> None:
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            spec.hidden_size, [size, size], parallel, False, dtype
        )
        self.down_proj = RowParallelLinear(size, spec.hidden_size, parallel, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


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
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(spec, layer_id, rotary, parallel, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(spec, parallel, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


# checkpoint name suffix -> (module path suffix, fused part index)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, spec: ModelSpec, parallel: ParallelState, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = VocabParallelEmbedding(
            spec.vocab_size, spec.hidden_size, parallel, dtype
        )
        rotary = RotaryEmbedding(
            spec.head_dim, spec.max_position, spec.rope_theta, spec.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, i, rotary, parallel, dtype) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, parallel, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, hidden)."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32 logits."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named tensors; every parameter must be covered exactly."""
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights.items():
            target, param, part = self._resolve(name)
            if target not in modules:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")
            modules[target].load(param, tensor, part)
            loaded.add(f"{target}.{param}")
        if "lm_head.weight" not in loaded and self.spec.tie_word_embeddings:
            self.lm_head.load("weight", weights["model.embed_tokens.weight"])
            loaded.add("lm_head.weight")
        missing = {n for n, _ in self.named_parameters()} - loaded
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {min(missing)}")

    @staticmethod
    def _resolve(name: str) -> tuple[str, str, int]:
        path, _, param = name.rpartition(".")
        path = path.removeprefix("model.")
        for suffix, (fused, part) in _FUSED.items():
            if path.endswith(suffix):
                return path[: -len(suffix)] + fused, param, part
        return path, param, 0
