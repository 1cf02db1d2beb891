"""The fused decoder layer (``kernels/cpu/csrc/decoder_layer.cpp``) on a small quantized Llama:
it computes what the layer's modules compute, and a token's logits are bit for bit the same
whether its prompt is prefilled at once, in chunks, decoded token by token or batched with
other requests (what lets greedy output ignore chunking, prefix hits and held KV)."""

import dataclasses

import pytest
import torch
from model_helpers import TINY_LLAMA_SPEC, random_tokens
from paged_harness import Harness, Seq

from agentx.engine.models.blocks import DecoderLayer
from agentx.engine.models.llama import LlamaForCausalLM
from agentx.engine.parallel import SINGLE
from agentx.engine.runner.model_runner import finalize_weights
from agentx.kernels import cpu

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


def _model(bits: int) -> LlamaForCausalLM:
    torch.manual_seed(bits)
    model = LlamaForCausalLM(SPEC, SINGLE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.2)
    finalize_weights(model, f"int{bits}")
    return model.eval()


def _layers(model) -> list[DecoderLayer]:
    return [m for m in model.modules() if isinstance(m, DecoderLayer)]


@pytest.fixture(scope="module", params=[4, 8], ids=["int4", "int8"])
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
