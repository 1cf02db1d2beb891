"""The kernel backends' contracts: ``ref``, ``cpu`` and ``triton`` export the same ops under the
same parameter names in the same order (a backend lacks an op only where listed below, with the
reason), and the fused layer's weights are one record that both sides of the C++ boundary read
in the same order."""

import inspect
from collections.abc import Callable

import pytest
import torch

from agentx import kernels
from agentx.kernels import cpu, ref
from agentx.kernels.cpu import FusedLayerStack, FusedLayerWeights, FusedLinear
from agentx.kernels.ref import quant as ref_quant

# The reference's ops: its package, plus the quantized linear layer (ref/quant.py, which the
# dispatch imports on its own).
REF_OPS: dict[str, Callable] = {name: getattr(ref, name) for name in ref.__all__}
REF_OPS["quantized_linear"] = ref_quant.quantized_linear

CPU_LACKS = {
    # elementwise ops, norms, RoPE and the KV write: on CPU they run inside the fused layer
    # (fused_decoder_layer) where a layer's shape allows it, else as the reference's torch ops
    "apply_rotary",
    "fused_add_rms_norm",
    "gelu_tanh_and_mul",
    "rms_norm",
    "rms_norm_gated",
    "silu_and_mul",
    "write_kv",
    # linear attention (Qwen3-Next's gated delta rule and its causal conv): reference only
    "causal_conv1d",
    "conv_window",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    # mixture of experts: reference only
    "moe_expert_slots",
    "moe_experts",
    "sum_expert_slots",
    "topk_softmax",
    # attention with its log-sum-exp, and decode context parallel's partial attention and
    # merge: reference only (the compiled attention returns the output alone)
    "merge_attention_parts",
    "paged_attention_partial",
    "paged_attention_with_lse",
}
CPU_ONLY = {
    # no reference op: tests/kernels/test_fused_layer.py compares it with the layer's own
    # modules, and its weights' contract is checked below
    "fused_decoder_layer",
    # consecutive fused layers in one call (the same op layer by layer): tested in
    # tests/kernels/test_fused_layer.py against the layer loop
    "fused_decoder_layers",
    # greedy sampling's argmax (torch.argmax is its reference): tests/kernels/test_kernels_cpu.py
    "argmax_rows",
    # a host-side layout helper for the compiled attention (token_req / token_len), not an op
    "token_layout",
}
# the backend's controls and records, not ops
CPU_CONTROLS = {
    "FusedLayerStack",
    "FusedLayerWeights",
    "FusedLinear",
    "attention_bf16_products",
    "available",
    "get_build_dir",
    "get_isa",
    "has_amx",
    "has_avx512",
    "isas",
    "use_isa",
}

TRITON_LACKS = {
    # packed int4 / int8 and K-quant GEMMs are CPU kernels; on a GPU `auto` keeps float weights
    "quantized_linear",
    # the conv window is a gather of a few rows, left to torch
    "conv_window",
    # mixture of experts: reference only
    "moe_expert_slots",
    "moe_experts",
    "sum_expert_slots",
    "topk_softmax",
    # decode context parallel's partial attention and merge: reference only (for now)
    "merge_attention_parts",
    "paged_attention_partial",
}

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _ops(module, controls: set[str] = frozenset()) -> dict[str, Callable]:
    return {name: getattr(module, name) for name in module.__all__ if name not in controls}


def _assert_same_parameters(name: str, backend: Callable, reference: Callable) -> None:
    """Same positional parameters (names, order, kind) as the reference, and the reference's
    defaults kept; a backend may add keyword-only launch options or ``**kwargs``, and may give
    a default where the reference has none."""
    want = list(inspect.signature(reference).parameters.values())
    got = list(inspect.signature(backend).parameters.values())
    assert [(p.name, p.kind) for p in got if p.kind in _POSITIONAL] == [
        (p.name, p.kind) for p in want
    ], name
    extra = [p for p in got if p.kind not in _POSITIONAL]
    assert all(
        p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD) for p in extra
    ), name
    defaults = {p.name: p.default for p in got}
    for p in want:
        if p.default is not inspect.Parameter.empty:
            assert defaults[p.name] == p.default, f"{name}: {p.name}"


def test_every_reference_op_is_a_plain_function_of_named_parameters():
    for name, op in REF_OPS.items():
        kinds = {p.kind for p in inspect.signature(op).parameters.values()}
        assert kinds <= set(_POSITIONAL), name


def test_cpu_backend_has_the_reference_ops_it_claims_with_their_parameters():
    ops = _ops(cpu, CPU_CONTROLS)
    assert set(ops) == (set(REF_OPS) - CPU_LACKS) | CPU_ONLY
    assert CPU_LACKS <= set(REF_OPS)  # the list names only real ops
    for name in set(ops) - CPU_ONLY:
        _assert_same_parameters(name, ops[name], REF_OPS[name])


def test_triton_backend_has_the_reference_ops_it_claims_with_their_parameters():
    triton_backend = pytest.importorskip(
        "agentx.kernels.triton", reason="triton is not installed (the dev extra installs it)"
    )
    ops = _ops(triton_backend)
    assert set(ops) == set(REF_OPS) - TRITON_LACKS
    assert TRITON_LACKS <= set(REF_OPS)
    for name, op in ops.items():
        _assert_same_parameters(name, op, REF_OPS[name])


def test_dispatch_exports_every_op_of_every_backend():
    assert set(REF_OPS) | CPU_ONLY <= set(kernels.__all__)
    # the fused layer goes through with its own signature (the record, not two lists)
    assert kernels.fused_decoder_layer is cpu.fused_decoder_layer
    assert kernels.fused_decoder_layers is cpu.fused_decoder_layers


# -- the fused layer's weights ---------------------------------------------------------------


def _distinct_weights() -> FusedLayerWeights:
    counter = iter(range(100))

    def t() -> torch.Tensor:
        return torch.full((1,), float(next(counter)))

    def lin(bits: int) -> FusedLinear:
        return FusedLinear(t(), t(), t(), bits)

    return FusedLayerWeights(t(), lin(12), lin(14), lin(0), t(), lin(4), t(), lin(8), lin(12))


def test_fused_weights_pack_in_field_order():
    tensors, bits = _distinct_weights().packed
    assert [int(x) for x in tensors] == list(range(21))
    assert bits == [12, 14, 0, 4, 8, 12]
    names = FusedLayerWeights.field_names()
    assert [n for n in names if not n.endswith(".bits")] == [
        "input_norm",
        "qkv_proj.qweight",
        "qkv_proj.scale",
        "qkv_proj.mins",
        "qkv_proj_1.qweight",
        "qkv_proj_1.scale",
        "qkv_proj_1.mins",
        "qkv_proj_2.qweight",
        "qkv_proj_2.scale",
        "qkv_proj_2.mins",
        "qkv_bias",
        "o_proj.qweight",
        "o_proj.scale",
        "o_proj.mins",
        "post_attention_norm",
        "gate_up_proj.qweight",
        "gate_up_proj.scale",
        "gate_up_proj.mins",
        "down_proj.qweight",
        "down_proj.scale",
        "down_proj.mins",
    ]
    assert [n for n in names if n.endswith(".bits")] == [
        "qkv_proj.bits",
        "qkv_proj_1.bits",
        "qkv_proj_2.bits",
        "o_proj.bits",
        "gate_up_proj.bits",
        "down_proj.bits",
    ]


needs_kernels = pytest.mark.skipif(
    not cpu.available(), reason="the compiled CPU kernels need an AVX2 CPU and a C++ compiler"
)


@needs_kernels
def test_cpp_op_reads_the_fields_in_the_records_order():
    assert torch.ops.agentx.fused_layer_fields() == FusedLayerWeights.field_names()


@needs_kernels
def test_cpp_op_schema_matches_the_python_wrapper():
    schema = torch.ops.agentx.fused_decoder_layer.default._schema
    wrapper = list(inspect.signature(cpu.fused_decoder_layer).parameters)
    # the record travels as its two lists; None windows as 0
    expected = []
    for name in wrapper:
        expected += {"weights": ["weights", "bits"], "sliding_window": ["window"]}.get(name, [name])
    assert [a.name for a in schema.arguments] == expected
    assert str(schema.arguments[3].type) == "List[Tensor]"
    assert str(schema.arguments[4].type) == "List[int]"


def _layer_call(weights: list[torch.Tensor], bits: list[int], hidden: int = 64):
    rows = 2
    index = torch.zeros(rows, dtype=torch.long)
    return torch.ops.agentx.fused_decoder_layer(
        torch.zeros(rows, hidden),
        index,
        torch.zeros(8, 64),
        weights,
        bits,
        torch.zeros(1, 2, 16, 1, 64),
        index,
        torch.zeros(1, 1, dtype=torch.long),
        index,
        index + 1,
        1,
        1e-6,
        0.125,
        0,
    )


@needs_kernels
def test_cpp_op_rejects_a_wrong_count_naming_the_contract():
    tensors, bits = _distinct_weights().packed
    with pytest.raises(RuntimeError, match=r"21 weights and 6 bits expected .*got 20 and 6"):
        _layer_call(tensors[:-1], bits)
    with pytest.raises(RuntimeError, match=r"21 weights and 6 bits expected .*got 21 and 5"):
        _layer_call(tensors, bits[:-1])


@needs_kernels
def test_layers_op_takes_one_layers_lists_per_kv_cache():
    tensors, bits = _distinct_weights().packed
    index = torch.zeros(2, dtype=torch.long)
    caches = [torch.zeros(1, 2, 16, 1, 64)] * 2  # two layers' caches, one layer's lists
    args = (torch.zeros(1, 1, dtype=torch.long), index, index + 1, 1, 1e-6, 0.125, 0)
    with pytest.raises(RuntimeError, match=r"21 weights and 6 bits a KV cache expected, got 21"):
        torch.ops.agentx.fused_decoder_layers(
            torch.zeros(2, 64), index, torch.zeros(8, 64), tensors, bits, caches, index, *args
        )
    stack = FusedLayerStack((_distinct_weights(),) * 2)
    assert stack.packed == (tensors * 2, bits * 2)
    with pytest.raises(ValueError, match="2 layers but 1 KV caches"):
        cpu.fused_decoder_layers(
            torch.zeros(2, 64), index, torch.zeros(8, 64), stack, caches[:1], index, *args
        )
    with pytest.raises(ValueError, match="at least one layer"):
        FusedLayerStack(())


@needs_kernels
def test_cpp_op_rejects_a_bad_field_by_name():
    hidden = 64
    norm = torch.ones(hidden)
    qweight4 = torch.zeros(1, 8, 32, dtype=torch.uint8)
    scale = torch.zeros(1, 2, 8)
    good = FusedLinear(qweight4, scale, scale, 4)

    def call(**fields):
        base = {
            "input_norm": norm,
            "qkv_proj": good,
            "qkv_proj_1": FusedLinear.absent(),
            "qkv_proj_2": FusedLinear.absent(),
            "qkv_bias": torch.empty(0),
            "o_proj": good,
            "post_attention_norm": norm,
            "gate_up_proj": good,
            "down_proj": good,
        }
        return _layer_call(*FusedLayerWeights(**(base | fields)).packed, hidden=hidden)

    with pytest.raises(
        RuntimeError, match=r"post_attention_norm must be a contiguous float32 \(64,\)"
    ):
        call(post_attention_norm=torch.ones(hidden + 1))
    with pytest.raises(RuntimeError, match=r"input_norm must be a contiguous float32"):
        call(input_norm=norm.double())
    with pytest.raises(RuntimeError, match=r"o_proj\.bits must be 4, 8, 12 \(Q4_K\) or 14"):
        call(o_proj=good._replace(bits=5))
    with pytest.raises(RuntimeError, match=r"down_proj\.qweight must be 3-D int8 for bits 8"):
        call(down_proj=good._replace(bits=8))  # an int4 (uint8) weight said to be int8
    with pytest.raises(RuntimeError, match=r"gate_up_proj\.qweight must be 2-D uint8 for bits 12"):
        call(gate_up_proj=good._replace(bits=12))
    with pytest.raises(RuntimeError, match=r"qkv_proj\.scale must be float32"):
        call(qkv_proj=good._replace(scale=scale.double()))
    with pytest.raises(RuntimeError, match=r"o_proj\.mins must be float32"):
        call(o_proj=good._replace(mins=scale.half()))
    # the further runs of q | k | v are K-quant weights or absent; the bias a float32 vector
    with pytest.raises(RuntimeError, match=r"qkv_proj_2\.bits must be 0 \(absent\), 12 \(Q4_K\)"):
        call(qkv_proj_2=good)
    with pytest.raises(RuntimeError, match=r"qkv_proj_1\.qweight must be 2-D uint8 for bits 14"):
        call(qkv_proj_1=good._replace(bits=14))
    with pytest.raises(RuntimeError, match=r"qkv_bias must be a contiguous 1-D float32 tensor"):
        call(qkv_bias=torch.zeros(8, dtype=torch.float64))
    # widths: one int4 q | k | v of 192 columns (q 64, k 64, v 64) fits the call's one head
    tiles = 192 // 8
    qkv = FusedLinear(
        torch.zeros(tiles, 8, 32, dtype=torch.uint8),
        torch.zeros(tiles, 2, 8),
        torch.zeros(tiles, 2, 8),
        4,
    )
    with pytest.raises(RuntimeError, match=r"qkv_bias must be empty or \(192,\), got \(191,\)"):
        call(qkv_proj=qkv, qkv_bias=torch.zeros(191))
    run = FusedLinear(torch.zeros(8, 144, dtype=torch.uint8), scale, scale, 12)
    with pytest.raises(RuntimeError, match=r"its runs give 200 columns, the heads need 192"):
        call(qkv_proj=qkv, qkv_proj_1=run)


def test_fused_weights_take_one_to_three_qkv_runs():
    def lin(bits: int) -> FusedLinear:
        return FusedLinear(torch.zeros(1), torch.zeros(1), torch.zeros(1), bits)

    norm = torch.ones(4)
    others = {
        "input_norm": norm,
        "o_proj": lin(4),
        "post_attention_norm": norm,
        "gate_up_proj": lin(4),
        "down_proj": lin(4),
    }
    weights = FusedLayerWeights.with_qkv_runs([lin(12), lin(14)], None, **others)
    assert (weights.qkv_proj.bits, weights.qkv_proj_1.bits, weights.qkv_proj_2.bits) == (12, 14, 0)
    assert weights.qkv_proj_2.qweight.numel() == 0 and weights.qkv_bias.numel() == 0
    bias = torch.arange(3.0)
    assert FusedLayerWeights.with_qkv_runs([lin(4)], bias, **others).qkv_bias is bias
    for runs in ([], [lin(12)] * 4):
        with pytest.raises(ValueError, match=r"qkv_proj takes 1 to 3 runs, got"):
            FusedLayerWeights.with_qkv_runs(runs, None, **others)
