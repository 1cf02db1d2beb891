"""The fused decoder layer (``kernels/cpu/csrc/decoder_layer.cpp``) on a small quantized Llama
and a Qwen2-shaped one (q | k | v with a bias, in K-quant runs of different types as a Q4_K_M
file has them): it computes what the layer's modules compute, and a token's logits are bit for
bit the same whether its prompt is prefilled at once, in chunks, decoded token by token or
batched with other requests (what lets greedy output ignore chunking, prefix hits and held
KV)."""

import dataclasses

import pytest
import torch

from agentx import kernels
from agentx.engine.models.blocks import DecoderLayer, FusedLayers
from agentx.engine.models.layers import MIXED, ColumnParallelLinear, QuantizableLinear
from agentx.engine.models.llama import LlamaForCausalLM
from agentx.engine.models.quant import KQuantTensor
from agentx.engine.parallel import SINGLE
from agentx.engine.runner.model_runner import finalize_weights
from agentx.kernels import cpu
from agentx.kernels.cpu import FusedLayerWeights
from agentx.kernels.ref import kquant
from tests.helpers.kquant import random_blocks
from tests.helpers.models import TINY_LLAMA_SPEC, random_tokens
from tests.helpers.paged_harness import Harness, Seq

pytestmark = pytest.mark.skipif(
    not kernels.cpu_kernels_enabled(),
    reason="the fused layer is a compiled CPU kernel: it needs an AVX2 CPU, a C++ compiler and "
    "AGENTX_KERNELS other than ref or triton (models fuse only when the compiled kernels serve)",
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
# Qwen2.5-Coder's shape, smaller: head_dim 128, GQA 6:1, a q/k/v bias
QWEN_SPEC = dataclasses.replace(
    SPEC,
    hidden_size=768,
    intermediate_size=1280,
    num_heads=6,
    num_kv_heads=1,
    head_dim=128,
    attention_bias=True,
)
Q4, Q6 = kquant.Q4_K, kquant.Q6_K
# q, k, v types per layer: two runs (q | k Q4_K, v Q6_K, as half the real file's layers) and
# three (the most the op takes)
QWEN_QKV_KINDS = [(Q4, Q4, Q6), (Q4, Q6, Q4)]


def _model(bits: int | str) -> LlamaForCausalLM:
    torch.manual_seed({"kquant": 0, "qwen": 1}.get(bits, bits))
    model = LlamaForCausalLM({"kquant": KQUANT_SPEC, "qwen": QWEN_SPEC}.get(bits, SPEC), SINGLE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.2)
    if bits in ("kquant", "qwen"):
        _load_kquant_projections(model, QWEN_QKV_KINDS if bits == "qwen" else None)
    finalize_weights(model, "auto" if bits in ("kquant", "qwen") else f"int{bits}")
    return model.eval()


def _load_kquant_projections(
    model: LlamaForCausalLM, qkv_kinds: list[tuple[int, ...]] | None
) -> None:
    """Q4_K attention and Q6_K MLP projections, as a Q4_K_M file has them; layer i's q, k, v
    in the types ``qkv_kinds[i]`` when given."""
    for name, module in model.named_modules():
        if not isinstance(module, QuantizableLinear) or "layers." not in name:
            continue
        out_features, in_features = module.weight.shape
        sizes = module.output_sizes if isinstance(module, ColumnParallelLinear) else [out_features]
        kinds = [Q6 if ".mlp." in name else Q4] * len(sizes)
        if qkv_kinds is not None and name.endswith("qkv_proj"):
            parts = name.split(".")  # ...layers.<i>.self_attn.qkv_proj
            kinds = qkv_kinds[int(parts[parts.index("layers") + 1])]
        for part, (size, kind) in enumerate(zip(sizes, kinds, strict=True)):
            blocks = random_blocks(size, in_features, kind, seed=part, scale=0.0005)
            module.load("weight", KQuantTensor(blocks, kind), part)


def _layers(model) -> list[DecoderLayer]:
    return [m for m in model.modules() if isinstance(m, DecoderLayer)]


@pytest.fixture(
    scope="module", params=[4, 8, "kquant", "qwen"], ids=["int4", "int8", "kquant", "qwen"]
)
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


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "modules"])
def test_the_last_layer_computes_the_kept_rows_as_among_all(model, fused):
    saved = [layer._fused for layer in _layers(model)]
    if not fused:  # the modules' path runs every row and selects: the same contract
        for layer in _layers(model):
            layer._fused = None
    try:
        a, b = random_tokens(40, seed=3), random_tokens(3, seed=4)
        full = Harness(model)
        seqs = [Seq(), Seq()]
        whole = torch.cat(full.step([(seqs[0], a, ()), (seqs[1], b, ())]))
        kept = Harness(model)
        mine = [Seq(), Seq()]
        keep = torch.tensor([0, 17, 39, 42])  # rows of both requests, one the last of each
        (rows,) = kept.step([(mine[0], a, ()), (mine[1], b, ())], keep)
        assert torch.equal(rows, whole[keep])  # bit for bit
        # every row's K and V were written: the next tokens see the same context
        nxt = [random_tokens(1, seed=5), random_tokens(2, seed=6)]
        after_full = full.step([(seqs[0], nxt[0], ()), (seqs[1], nxt[1], ())])
        (none,) = kept.step(
            [(mine[0], nxt[0], ()), (mine[1], nxt[1], ())], torch.tensor([], dtype=torch.long)
        )
        assert none.shape[0] == 0
        again = Harness(model)
        fresh = [Seq(), Seq()]
        again.step([(fresh[0], a, ()), (fresh[1], b, ())], torch.tensor([], dtype=torch.long))
        after_none = again.step([(fresh[0], nxt[0], ()), (fresh[1], nxt[1], ())])
        for x, y in zip(after_full, after_none, strict=True):
            assert torch.equal(x, y)
    finally:
        for layer, f in zip(_layers(model), saved, strict=True):
            layer._fused = f


def test_the_layers_run_as_one_op_with_the_loops_bits(model, monkeypatch):
    # every layer in one call (blocks.FusedLayers -> fused_decoder_layers): a prefill of two
    # requests, then a step of a decode and a chunk with kept rows, give the layer-by-layer
    # loop's logits bit for bit
    assert isinstance(model._layers_as_one(), FusedLayers)
    runs = []
    run = FusedLayers.run

    def counted(self, *args):
        out = run(self, *args)
        runs.append(out is not None)
        return out

    def steps() -> list[torch.Tensor]:
        harness, seqs = Harness(model), [Seq(), Seq()]
        a, b = random_tokens(40, seed=7), random_tokens(3, seed=8)
        out = harness.step([(seqs[0], a, ()), (seqs[1], b, ())])
        nxt = [random_tokens(1, seed=9), random_tokens(20, seed=10)]
        out += harness.step(
            [(s, t, ()) for s, t in zip(seqs, nxt, strict=True)], torch.tensor([0, 5, 20])
        )
        return out

    monkeypatch.setattr(FusedLayers, "run", counted)
    one_op = steps()
    assert runs == [True, True]
    monkeypatch.setattr(FusedLayers, "run", lambda self, *args: None)  # the loop
    looped = steps()
    assert len(one_op) == len(looped) == 3
    for x, y in zip(one_op, looped, strict=True):
        assert torch.equal(x, y)


def test_the_layers_run_one_by_one_where_one_does_not_fuse(model):
    layers = _layers(model)
    assert model._layers_as_one() is not None
    saved = layers[-1]._fused
    layers[-1]._fused = None  # the model notices the change: the loop runs
    try:
        assert model._layers_as_one() is None
    finally:
        layers[-1]._fused = saved
    assert model._layers_as_one() is not None


def test_kept_rows_must_ascend_once_each(model):
    layer = _layers(model)[0]
    x = torch.randn(6, layer.self_attn.qkv_proj.in_features)
    for bad in ([2, 1], [3, 3], [6], [-1]):
        with pytest.raises(RuntimeError, match="keep must list rows"):
            _call_layer(layer, layer._fused, x, torch.arange(6), 1e-6, torch.tensor(bad))


# -- Qwen2: q | k | v with a bias, in K-quant runs ------------------------------------------


@pytest.fixture(scope="module")
def qwen():
    return _model("qwen")


def test_every_qwen_layer_fuses_with_its_runs_and_bias(qwen):
    for layer, kinds in zip(_layers(qwen), QWEN_QKV_KINDS, strict=True):
        qkv, fused = layer.self_attn.qkv_proj, layer._fused
        assert layer.fusable() and fused is not None
        runs = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
        assert qkv.bits == MIXED and list(qkv.segment_kinds) == runs
        fused_runs = [fused.qkv_proj, fused.qkv_proj_1, fused.qkv_proj_2]
        assert [r.bits for r in fused_runs] == runs + [0] * (3 - len(runs))
        for (qweight, _), run in zip(qkv.get_runs(), fused_runs, strict=False):
            assert run.qweight.data_ptr() == qweight.data_ptr()  # the layer's own blocks
        assert torch.equal(fused.qkv_bias, qkv.bias) and fused.qkv_bias.abs().sum() > 0


def _call_layer(
    layer: DecoderLayer,
    weights,
    x: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused op on x's rows as one request's prompt in fresh blocks 1, 2, ...: its output,
    and the K and V rows it wrote to the cache, (T, Hkv * D) each."""
    attn, rows = layer.self_attn, x.shape[0]
    block_size = 16
    num_blocks = -(-rows // block_size) + 1  # block 0 stays unused, as the null block
    kv_cache = torch.zeros(num_blocks, 2, block_size, attn.num_kv_heads, attn.head_dim)
    out = cpu.fused_decoder_layer(
        x,
        positions,
        attn.rotary.cos_sin_cache,
        weights,
        kv_cache,
        torch.arange(rows) + block_size,
        torch.arange(1, num_blocks).unsqueeze(0),
        torch.zeros(rows, dtype=torch.long),
        torch.arange(1, rows + 1),
        attn.num_heads,
        eps,
        attn.attn.scale,
        None,
        keep,
    )
    width = attn.num_kv_heads * attn.head_dim
    k, v = (kv_cache[1:, i].reshape(-1, width)[:rows] for i in (0, 1))  # (T, Hkv * D)
    return out, k, v


ISAS = cpu.isas() if cpu.available() else ["avx2"]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 7, 40])  # a decode row, a few, the AVX2 GEMM's many
def test_fused_qkv_runs_and_bias_give_the_modules_k_and_v_bit_for_bit(qwen, rows, isa):
    # Rows of +-1 with an eps below fp32's resolution at 1 make RMSNorm exact (mean square 1,
    # scale 1: h = x * w), and position 0 makes RoPE the identity, so the cache holds the qkv
    # projection's own k and v columns; the modules' MIXED projection must give those bits.
    gen = torch.Generator().manual_seed(rows)
    for layer in _layers(qwen):
        attn, norm = layer.self_attn, layer.input_layernorm.weight
        x = torch.randint(0, 2, (rows, norm.shape[0]), generator=gen).float() * 2 - 1
        with cpu.use_isa(isa):
            _, k, v = _call_layer(layer, layer._fused, x, torch.zeros(rows, dtype=torch.long), 1e-9)
            qkv = attn.qkv_proj(x * norm)  # (T, q + 2 kv) through the unfused runs, + bias
        q_width, kv_width = attn.num_heads * attn.head_dim, k.shape[1]
        assert torch.equal(k, qkv[:, q_width : q_width + kv_width])
        assert torch.equal(v, qkv[:, q_width + kv_width :])


def test_qkv_runs_split_anywhere_give_the_same_layer(qwen):
    # layer 0's q | k run cut in two: each run writes its own columns, so nothing changes
    layer = _layers(qwen)[0]
    fused, attn = layer._fused, layer.self_attn
    q_width = attn.num_heads * attn.head_dim
    first = fused.qkv_proj
    q_run = first._replace(qweight=first.qweight[:q_width])
    k_run = first._replace(qweight=first.qweight[q_width:])
    split = FusedLayerWeights.with_qkv_runs(
        [q_run, k_run, fused.qkv_proj_1],
        fused.qkv_bias,
        input_norm=fused.input_norm,
        o_proj=fused.o_proj,
        post_attention_norm=fused.post_attention_norm,
        gate_up_proj=fused.gate_up_proj,
        down_proj=fused.down_proj,
    )
    x = torch.randn(9, fused.input_norm.shape[0], generator=torch.Generator().manual_seed(3))
    positions = torch.arange(20, 29)
    eps = layer.input_layernorm.eps
    for got, want in zip(
        _call_layer(layer, split, x, positions, eps),
        _call_layer(layer, fused, x, positions, eps),
        strict=True,
    ):
        assert torch.equal(got, want)
