"""The fused decoder layer (``kernels/cpu/csrc/decoder_layer.cpp``) on a small quantized Llama:
it computes what the layer's modules compute, and a token's logits are bit for bit the same
whether its prompt is prefilled at once, in chunks, decoded token by token or batched with
other requests (what lets greedy output ignore chunking, prefix hits and held KV)."""

import dataclasses

import pytest
import torch

from agentx.engine.models.blocks import DecoderLayer
from agentx.engine.models.layers import ColumnParallelLinear, QuantizableLinear
from agentx.engine.models.llama import LlamaForCausalLM
from agentx.engine.models.quant import KQuantTensor
from agentx.engine.parallel import SINGLE
from agentx.engine.runner.model_runner import finalize_weights
from agentx.kernels import cpu
from agentx.kernels.ref import kquant
from tests.helpers.kquant import random_blocks
from tests.helpers.models import TINY_LLAMA_SPEC, random_tokens
from tests.helpers.paged_harness import Harness, Seq

pytestmark = pytest.mark.skipif(
    not cpu.available(), reason="the compiled CPU kernels need an AVX2 CPU and a C++ compiler"
)

# head_dim 64 (the kernel's smallest), GQA 3:1, two layers
SPEC = dataclasses.replace(
    TINY_LLAMA_SPEC,
    vocab_size=384,  # random_tokens draws ids below 384
    hidden_size=96,
    intermediate_size=160,
    num_layers=2,
    num_heads=3,
    num_kv_heads=1,
    head_dim=64,
    max_position=1024,
)


# K-quant weights need whole super-blocks of 256 input features
KQUANT_SPEC = dataclasses.replace(SPEC, hidden_size=256, intermediate_size=256, num_heads=4)


def _model(bits: int | str) -> LlamaForCausalLM:
    torch.manual_seed(0 if bits == "kquant" else bits)
    model = LlamaForCausalLM(KQUANT_SPEC if bits == "kquant" else SPEC, SINGLE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.2)
    if bits == "kquant":
        _load_kquant_projections(model)
    finalize_weights(model, "auto" if bits == "kquant" else f"int{bits}")
    return model.eval()


def _load_kquant_projections(model: LlamaForCausalLM) -> None:
    """Q4_K attention and Q6_K MLP projections, as a Q4_K_M file has them."""
    for name, module in model.named_modules():
        if not isinstance(module, QuantizableLinear) or "layers." not in name:
            continue
        kind = kquant.Q6_K if ".mlp." in name else kquant.Q4_K
        out_features, in_features = module.weight.shape
        sizes = module.output_sizes if isinstance(module, ColumnParallelLinear) else [out_features]
        for part, size in enumerate(sizes):
            blocks = random_blocks(size, in_features, kind, seed=part, scale=0.0005)
            module.load("weight", KQuantTensor(blocks, kind), part)


def _layers(model) -> list[DecoderLayer]:
    return [m for m in model.modules() if isinstance(m, DecoderLayer)]


@pytest.fixture(scope="module", params=[4, 8, "kquant"], ids=["int4", "int8", "kquant"])
def model(request):
    model = _model(request.param)
    assert all(layer._fused is not None for layer in _layers(model))
    return model


def test_fused_layer_matches_the_modules(model):
    ids = random_tokens(70, seed=1)
    (fused,) = Harness(model).step([(Seq(), ids, ())])
    saved = [layer._fused for layer in _layers(model)]
    try:
        for layer in _layers(model):
            layer._fused = None
        (modules,) = Harness(model).step([(Seq(), ids, ())])
    finally:
        for layer, f in zip(_layers(model), saved, strict=True):
            layer._fused = f
    # the same math in another float order; int8 activations can round a group differently
    torch.testing.assert_close(fused, modules, rtol=0, atol=0.02 * modules.abs().max().item())
    assert (fused.argmax(-1) == modules.argmax(-1)).float().mean() > 0.95


def test_rows_do_not_depend_on_chunking_or_batching(model):
    ids = random_tokens(600, seed=2)  # crosses a 512-key split
    (whole,) = Harness(model).step([(Seq(), ids, ())])
    harness = Harness(model)
    seq, out, at = Seq(), [], 0
    for size in (37, 1, 1, 300, 1, 250, 1, 9):  # chunks and single-token decode steps
        other = Seq()
        work = [(other, random_tokens(5, seed=at), ())]
        logits, _ = harness.step([(seq, ids[at : at + size], ()), *work])
        out.append(logits)
        at += size
    assert at == len(ids)
    assert torch.equal(torch.cat(out), whole)  # bit for bit
