"""Qwen3-Next: Gated DeltaNet layers interleaved with gated full attention, MoE MLPs.

token ids -> embed -> [ RMSNorm* -> token mixer -> + -> RMSNorm* -> MLP -> + ] x N -> RMSNorm*
          -> lm_head

    token mixer   "linear_attention": Gated DeltaNet (gated_deltanet.py, paged recurrent state)
                  "full_attention":   q_proj -> [q | gate] per head, q/k RMSNorm*, partial RoPE,
                                      paged attention, * sigmoid(gate), o_proj
    MLP           sparse MoE with a gated shared expert (moe.py), or a dense SwiGLU on
                  ``mlp_only_layers`` / off the ``decoder_sparse_step``
    RMSNorm*      zero-centered: x_normed * (1 + w), in fp32 (``NormWeight.OFFSET_FP32``)

Everything Qwen3-Next-specific the loader reads from config.json sits in :class:`Qwen3NextConfig`
(``ModelSpec.arch_config``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentx.engine.models.base import CausalLM
from agentx.engine.models.blocks import Attention, DecoderLayer, GatedMLP, NormWeight
from agentx.engine.models.gated_deltanet import GatedDeltaNet, LinearStepPlanner
from agentx.engine.models.layers import RotaryEmbedding
from agentx.engine.models.moe import SparseMoeBlock
from agentx.engine.models.spec import ModelSpec
from agentx.engine.parallel import ParallelState
from agentx.errors import ModelLoadError

ZERO_CENTERED = NormWeight.OFFSET_FP32


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


def _make_layer(
    spec: ModelSpec,
    layer_id: int,
    rotary: RotaryEmbedding,
    planner: LinearStepPlanner,
    parallel: ParallelState,
    dtype: torch.dtype,
) -> DecoderLayer:
    config: Qwen3NextConfig = spec.arch_config
    hidden = spec.hidden_size
    if spec.get_layer_type(layer_id) == "linear_attention":
        mixer_name = "linear_attn"
        mixer = GatedDeltaNet(hidden, config, spec.rms_norm_eps, layer_id, planner, parallel, dtype)
    else:
        mixer_name = "self_attn"
        mixer = Attention(
            spec, layer_id, rotary, parallel, dtype, qk_norm=ZERO_CENTERED, output_gate=True
        )
    if config.is_moe_layer(layer_id):
        mlp = SparseMoeBlock(
            hidden,
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            config.shared_expert_intermediate_size,
            config.norm_topk_prob,
            parallel,
            dtype,
        )
    else:
        mlp = GatedMLP(hidden, spec.intermediate_size, parallel, dtype, "silu")
    return DecoderLayer(spec, dtype, mixer_name, mixer, mlp, ZERO_CENTERED)


class Qwen3NextForCausalLM(CausalLM):
    # Conv and recurrent states alike: the delta rule accumulates over the whole sequence.
    linear_state_dtype = torch.float32
    skipped_prefixes = ("mtp.",)  # the multi-token-prediction head: not used for decoding

    def __init__(
        self, spec: ModelSpec, parallel: ParallelState, dtype: torch.dtype = torch.float32
    ) -> None:
        if not isinstance(spec.arch_config, Qwen3NextConfig):
            raise ModelLoadError("a qwen3_next spec needs a Qwen3NextConfig as arch_config")
        rotary_dim = int(spec.head_dim * spec.arch_config.partial_rotary_factor)
        rotary = RotaryEmbedding(rotary_dim, spec.max_position, spec.rope_theta, spec.rope_scaling)
        planner = LinearStepPlanner()
        super().__init__(
            spec,
            parallel,
            dtype,
            lambda i: _make_layer(spec, i, rotary, planner, parallel, dtype),
            ZERO_CENTERED,
        )

    def get_linear_state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per linear layer: conv state (conv_dim, K-1), recurrent state (H_v, D_k, D_v)."""
        for layer in self.layers:
            if layer.mixer_name == "linear_attn":
                return layer.linear_attn.get_state_shapes()
        raise ValueError("this model has no linear-attention layer")
