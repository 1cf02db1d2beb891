"""The shared model blocks on their own: the three RMSNorm weight kinds, the MLP activations,
partial rotary, and the causal-LM shell's checkpoint-name resolution and coverage check."""

import pytest
import torch
from torch import nn

from agentx import kernels
from agentx.engine.models.blocks import Attention, GatedMLP, NormWeight, RMSNorm
from agentx.engine.models.layers import RotaryEmbedding
from agentx.engine.models.llama import LlamaForCausalLM
from agentx.engine.parallel import ParallelState
from agentx.errors import ModelLoadError
from tests.helpers.models import TINY_LLAMA_SPEC

SPEC = TINY_LLAMA_SPEC


def test_rms_norm_weight_kinds() -> None:
    w = torch.tensor([0.5, -0.25, 0.0, 2.0])
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    plain = RMSNorm(4, 1e-6)
    plain.load("weight", w)
    assert torch.equal(plain.weight, w)
    assert torch.equal(plain(x), kernels.rms_norm(x, w, 1e-6))

    folded = RMSNorm(4, 1e-6, torch.bfloat16, NormWeight.OFFSET_AT_LOAD)
    folded.load("weight", w.to(torch.bfloat16))
    assert torch.equal(folded.weight, (1.0 + w).to(torch.bfloat16))

    zero_centered = RMSNorm(4, 1e-6, torch.bfloat16, NormWeight.OFFSET_FP32)
    assert torch.equal(zero_centered.weight, torch.zeros(4, dtype=torch.bfloat16))
    zero_centered.load("weight", w.to(torch.bfloat16))
    assert torch.equal(zero_centered.weight, w.to(torch.bfloat16))
    x16 = x.to(torch.bfloat16)
    expected = kernels.rms_norm(x16.float(), 1.0 + w, 1e-6).to(torch.bfloat16)
    assert torch.equal(zero_centered(x16), expected)


@pytest.mark.parametrize(
    "activation, kernel", [("silu", kernels.silu_and_mul), ("gelu_tanh", kernels.gelu_tanh_and_mul)]
)
def test_gated_mlp_activation(activation: str, kernel) -> None:
    mlp = GatedMLP(4, 6, ParallelState(), torch.float32, activation)
    gen = torch.Generator().manual_seed(1)
    mlp.gate_up_proj.weight.data.copy_(torch.randn(12, 4, generator=gen))
    mlp.down_proj.weight.data.copy_(torch.randn(4, 6, generator=gen))
    x = torch.randn(5, 4, generator=gen)
    expected = nn.functional.linear(kernel(x @ mlp.gate_up_proj.weight.T), mlp.down_proj.weight)
    assert torch.equal(mlp(x), expected)


def test_gated_mlp_unknown_activation_is_named() -> None:
    with pytest.raises(ModelLoadError, match="'relu'"):
        GatedMLP(4, 6, ParallelState(), torch.float32, "relu")


def test_partial_rotary_rotates_only_the_leading_dims() -> None:
    rotary = RotaryEmbedding(4, SPEC.max_position, SPEC.rope_theta, None)  # 4 of 8 dims
    attn = Attention(SPEC, 0, rotary, ParallelState(), torch.float32)
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 1, 8, generator=gen)
    positions = torch.tensor([0, 5, 9])
    q_out, k_out = attn._rotate(positions, q, k)
    q_rot, k_rot = rotary(positions, q[..., :4], k[..., :4])
    assert torch.equal(q_out, torch.cat((q_rot, q[..., 4:]), dim=-1))
    assert torch.equal(k_out, torch.cat((k_rot, k[..., 4:]), dim=-1))
    assert not torch.equal(q_out[1:, :, :4], q[1:, :, :4])


def _llama_weights() -> dict[str, torch.Tensor]:
    shapes = {
        "model.embed_tokens.weight": (32, 16),
        "model.norm.weight": (16,),
        "model.layers.0.input_layernorm.weight": (16,),
        "model.layers.0.post_attention_layernorm.weight": (16,),
        "model.layers.0.self_attn.q_proj.weight": (16, 16),
        "model.layers.0.self_attn.k_proj.weight": (8, 16),
        "model.layers.0.self_attn.v_proj.weight": (8, 16),
        "model.layers.0.self_attn.o_proj.weight": (16, 16),
        "model.layers.0.mlp.gate_proj.weight": (24, 16),
        "model.layers.0.mlp.up_proj.weight": (24, 16),
        "model.layers.0.mlp.down_proj.weight": (16, 24),
    }
    gen = torch.Generator().manual_seed(3)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def test_load_weights_fills_fused_parts_and_ties_the_head() -> None:
    weights = _llama_weights()
    model = LlamaForCausalLM(SPEC, ParallelState())
    model.load_weights(weights)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    q, k, v = attn.qkv_proj.weight.split([16, 8, 8])
    assert torch.equal(q, weights["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(k, weights["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(v, weights["model.layers.0.self_attn.v_proj.weight"])
    gate, up = mlp.gate_up_proj.weight.split([24, 24])
    assert torch.equal(gate, weights["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(up, weights["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    "extra",
    [
        "model.layers.0.self_attn.rotary_emb.inv_freq",  # no such module
        "model.layers.0.weight",  # a module without a load
        "model.layers.0.shared_expert.gate_proj.weight",  # a fused part the model lacks
    ],
)
def test_load_weights_rejects_a_tensor_with_no_place(extra: str) -> None:
    model = LlamaForCausalLM(SPEC, ParallelState())
    with pytest.raises(ModelLoadError, match="no place"):
        model.load_weights({**_llama_weights(), extra: torch.zeros(1)})


def test_load_weights_names_a_missing_tensor() -> None:
    weights = _llama_weights()
    del weights["model.layers.0.mlp.down_proj.weight"]
    model = LlamaForCausalLM(SPEC, ParallelState())
    with pytest.raises(ModelLoadError, match="lacks 1 tensors, e.g. layers.0.mlp.down_proj"):
        model.load_weights(weights)
