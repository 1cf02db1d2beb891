"""Qwen3-Next: Gated DeltaNet layers interleaved with gated full attention, MoE MLPs.

token ids -> embed -> [ RMSNorm* -> token mixer -> + -> RMSNorm* -> MLP -> + ] x N -> RMSNorm*
          -> lm_head

    token mixer   "linear_attention": Gated DeltaNet (gated_deltanet.py, paged recurrent state)
                  "full_attention":   q_proj -> [q | gate] per head, q/k RMSNorm*, partial RoPE,
                                      paged attention, * sigmoid(gate), o_proj
    MLP           sparse MoE with a gated shared expert (moe.py), or a dense SwiGLU on
                  ``mlp_only_layers`` / off the ``decoder_sparse_step``
    RMSNorm*      zero-centered: x_normed * (1 + w)

Everything Qwen3-Next-specific the loader reads from config.json sits in :class:`Qwen3NextConfig`
(``ModelSpec.arch_config``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from agentx import kernels
from agentx.engine.models.attention import PagedAttention
from agentx.engine.models.gated_deltanet import GatedDeltaNet, LinearStepPlanner
from agentx.engine.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from agentx.engine.models.moe import GatedMLP, SparseMoeBlock
from agentx.engine.models.spec import ModelSpec
from agentx.engine.parallel import ParallelState
from agentx.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class Qwen3NextConfig:
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    partial_rotary_factor: float  # the leading fraction of each head dim that RoPE rotates
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()  # layers with a dense MLP (spec.intermediate_size)

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            layer_id not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose stored weight w scales by (1 + w), computed in float32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)

    def load(self, name: str, full: torch.Tensor, part: int = 0) -> None:
        self.weight.data.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x.float(), 1.0 + self.weight.float(), self.eps).to(x.dtype)


class Qwen3NextAttention(nn.Module):
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
        # q_proj is [q | gate] per head: (H, 2D) rows, one part so TP keeps heads whole
        self.qkv_proj = ColumnParallelLinear(
            spec.hidden_size, [2 * q_size, kv_size, kv_size], parallel, spec.attention_bias, dtype
        )
        self.q_norm = ZeroCenteredRMSNorm(spec.head_dim, spec.rms_norm_eps, dtype)
        self.k_norm = ZeroCenteredRMSNorm(spec.head_dim, spec.rms_norm_eps, dtype)
        self.o_proj = RowParallelLinear(q_size, spec.hidden_size, parallel, dtype)
        self.rotary = rotary
        self.rotary_dim = rotary.cos_sin_cache.shape[-1]
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, layer_id
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_gate, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q_gate = q_gate.view(-1, self.num_heads, 2 * self.head_dim)  # (T, H, 2D)
        q, gate = q_gate.chunk(2, dim=-1)  # (T, H, D) each
        q = self.q_norm(q)
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))  # (T, Hkv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self._rotate(positions, q, k)
        o = self.attn(q, k, v)  # (T, H, D)
        return self.o_proj((o * torch.sigmoid(gate)).flatten(1))

    def _rotate(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on the first ``rotary_dim`` dims of each head; the rest passes through."""
        r = self.rotary_dim
        q_rot, k_rot = self.rotary(positions, q[..., :r], k[..., :r])
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        layer_id: int,
        rotary: RotaryEmbedding,
        planner: LinearStepPlanner,
        parallel: ParallelState,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        config: Qwen3NextConfig = spec.arch_config
        self.input_layernorm = ZeroCenteredRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        # the token mixer keeps its checkpoint name: linear_attn or self_attn
        if spec.get_layer_type(layer_id) == "linear_attention":
            self.mixer_name = "linear_attn"
            self.linear_attn = GatedDeltaNet(
                spec.hidden_size, config, spec.rms_norm_eps, layer_id, planner, parallel, dtype
            )
        else:
            self.mixer_name = "self_attn"
            self.self_attn = Qwen3NextAttention(spec, layer_id, rotary, parallel, dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(
            spec.hidden_size, spec.rms_norm_eps, dtype
        )
        if config.is_moe_layer(layer_id):
            self.mlp = SparseMoeBlock(
                spec.hidden_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.moe_intermediate_size,
                config.shared_expert_intermediate_size,
                config.norm_topk_prob,
                parallel,
                dtype,
            )
        else:
            self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, parallel, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        mixer = getattr(self, self.mixer_name)
        x = x + mixer(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


# checkpoint name suffix -> (module path suffix, fused part index)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "shared_expert.gate_proj": ("shared_expert.gate_up_proj", 0),
    "shared_expert.up_proj": ("shared_expert.gate_up_proj", 1),
}
_SKIPPED_PREFIXES = ("mtp.",)  # the multi-token-prediction head: not used for decoding


class Qwen3NextForCausalLM(nn.Module):
    # Conv and recurrent states alike: the delta rule accumulates over the whole sequence.
    linear_state_dtype = torch.float32

    def __init__(
        self, spec: ModelSpec, parallel: ParallelState, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        if not isinstance(spec.arch_config, Qwen3NextConfig):
            raise ModelLoadError("a qwen3_next spec needs a Qwen3NextConfig as arch_config")
        self.spec = spec
        self.embed_tokens = VocabParallelEmbedding(
            spec.vocab_size, spec.hidden_size, parallel, dtype
        )
        rotary_dim = int(spec.head_dim * spec.arch_config.partial_rotary_factor)
        rotary = RotaryEmbedding(rotary_dim, spec.max_position, spec.rope_theta, spec.rope_scaling)
        planner = LinearStepPlanner()
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(spec, i, rotary, planner, parallel, dtype)
            for i in range(spec.num_layers)
        )
        self.norm = ZeroCenteredRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, parallel, dtype)

    def get_linear_state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per linear layer: conv state (conv_dim, K-1), recurrent state (H_v, D_k, D_v)."""
        for layer in self.layers:
            if layer.mixer_name == "linear_attn":
                return layer.linear_attn.get_state_shapes()
        raise ValueError("this model has no linear-attention layer")

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
        """Load Hugging Face-named tensors; every parameter must be covered."""
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights.items():
            if name.startswith(_SKIPPED_PREFIXES):
                continue
            target, param, part = _resolve(name, modules)
            module = modules[target]
            module.load(param, tensor, part)
            param_for = getattr(module, "param_for", None)
            loaded.add(f"{target}.{param_for(param) if param_for else param}")
        if "lm_head.weight" not in loaded and self.spec.tie_word_embeddings:
            self.lm_head.load("weight", weights["model.embed_tokens.weight"])
            loaded.add("lm_head.weight")
        missing = {n for n, _ in self.named_parameters()} - loaded
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {min(missing)}")


def _resolve(name: str, modules: dict[str, nn.Module]) -> tuple[str, str, int]:
    """Checkpoint name -> (module path, name the module's ``load`` gets, fused part).

    The deepest module with a ``load`` takes the rest of the name: ``mlp.experts`` gets
    ``0.gate_proj.weight``, ``linear_attn`` gets ``A_log``.
    """
    path, _, param = name.removeprefix("model.").rpartition(".")
    for suffix, (fused, part) in _FUSED.items():
        if path.endswith(suffix):
            return path[: -len(suffix)] + fused, param, part
    while not hasattr(modules.get(path), "load"):
        if not path:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")
        path, _, head = path.rpartition(".")
        param = f"{head}.{param}"
    return path, param, 0
