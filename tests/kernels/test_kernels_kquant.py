"""GGUF K-quant (Q4_K, Q6_K) weights: read exactly, multiplied in place.

The reference (``kernels/ref/kquant.py``) dequantizes as the gguf package does, bit for bit; the
compiled kernel equals the reference bit for bit on awkward shapes (N not a multiple of 8, 1, 3
and 17 rows, K from one super-block to 35), on every ISA this CPU runs, and a row's result does
not depend on the other rows; the int8-activation math stays close to the float matmul. A linear
layer keeps K-quant parts as they are, one kernel call a run of parts of one type.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from agentx.engine.models.layers import MIXED, ColumnParallelLinear, RowParallelLinear
from agentx.engine.models.quant import KQuantTensor
from agentx.engine.parallel import ParallelState
from agentx.kernels import cpu
from agentx.kernels.ref import kquant
from agentx.kernels.ref import quant as ref_quant
from tests.helpers.kquant import random_blocks

needs_kernels = pytest.mark.skipif(
    not cpu.available(), reason="the compiled CPU kernels need an AVX2 CPU and a C++ compiler"
)
KINDS = [kquant.Q4_K, kquant.Q6_K]
SHAPES = [(13, 256), (37, 512), (21, 8960)]  # (N, K)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_equals_gguf_bit_for_bit(kind):
    blocks = random_blocks(29, 768, kind)
    want = gguf_dequantize(blocks.numpy(), GGMLQuantizationType(kind)).reshape(29, 768)
    got = kquant.dequantize(blocks, kind).numpy()
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


def test_activation_quantization_exact_values():
    x = torch.zeros(2, 256)
    x[0, :4] = torch.tensor([1.0, -2.0, 0.5, 127.0])
    xq, dx, sums = kquant.quantize_activations(x)
    assert xq[0, :4].tolist() == [1, -2, 0, 127]  # 0.5 rounds half to even
    assert dx[0, 0].item() == 1.0 and dx[1, 0].item() == 0.0
    assert sums[0, 0, 0].item() == 126 and sums[1].abs().sum().item() == 0


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_equals_reference_bit_for_bit(kind, m, n, k):
    w = random_blocks(n, k, kind, seed=m)
    gen = torch.Generator().manual_seed(100 + m)
    x = torch.randn(m, k, generator=gen) * 3
    bias = torch.randn(n, generator=gen)
    want = kquant.kquant_linear(x, w, kind, bias)
    for isa in _isas():
        with cpu.use_isa(isa):
            assert torch.equal(cpu.quantized_linear(x, w, torch.empty(0), None, bias, kind), want)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_rows_are_independent(kind):
    w = random_blocks(45, 1536, kind)
    x = torch.randn(17, 1536, generator=torch.Generator().manual_seed(7))
    batch = torch.ops.agentx.kquant_linear(x, w, kind, None)
    for r in (0, 3, 4, 16):
        alone = torch.ops.agentx.kquant_linear(x[r : r + 1], w, kind, None)
        assert torch.equal(alone[0], batch[r])


@pytest.mark.skipif(
    not (cpu.available() and cpu.has_avx512()), reason="this CPU has no AVX-512 VNNI"
)
@pytest.mark.parametrize("kind", KINDS)
def test_avx512_equals_avx2(kind):
    w = random_blocks(37, 2560, kind)
    x = torch.randn(6, 2560, generator=torch.Generator().manual_seed(3))
    outs = []
    for isa in ("avx2", "avx512"):
        with cpu.use_isa(isa):
            outs.append(torch.ops.agentx.kquant_linear(x, w, kind, None))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kind", KINDS)
def test_math_close_to_dequantized_matmul(kind):
    w = random_blocks(64, 1024, kind)
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(1))
    want = x @ kquant.dequantize(w, kind).t()
    got = ref_quant.quantized_linear(x, w, torch.empty(0), None, None, kind)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_tensor_narrows_and_cats_whole_blocks():
    t = KQuantTensor(random_blocks(10, 768, kquant.Q6_K), kquant.Q6_K)
    assert t.shape == (10, 768)
    cols = t.narrow(1, 256, 512)
    assert torch.equal(cols.dequantize(), t.dequantize()[:, 256:768])
    both = KQuantTensor.cat([t.narrow(0, 0, 4), t.narrow(0, 4, 6)])
    assert torch.equal(both.data, t.data)
    with pytest.raises(ValueError, match="align"):
        t.narrow(1, 128, 256)


def _qkv(kinds: list[int]) -> tuple[ColumnParallelLinear, list[KQuantTensor]]:
    sizes = [24, 8, 8]
    layer = ColumnParallelLinear(512, sizes, ParallelState(0, 1), bias=True)
    parts = [
        KQuantTensor(random_blocks(s, 512, kd, seed=i), kd)
        for i, (s, kd) in enumerate(zip(sizes, kinds, strict=True))
    ]
    for i, part in enumerate(parts):
        layer.load("weight", part, i)
    layer.load("bias", torch.arange(24.0), 0)
    layer.load("bias", torch.arange(8.0), 1)
    layer.load("bias", torch.arange(8.0), 2)
    return layer, parts


@needs_kernels
def test_linear_keeps_mixed_kquant_parts_as_runs():
    layer, parts = _qkv([kquant.Q4_K, kquant.Q4_K, kquant.Q6_K])
    layer.finalize_weights("auto", kernels_ready=True)
    assert layer.bits == MIXED and layer.segment_kinds == (kquant.Q4_K, kquant.Q6_K)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    want = (
        torch.cat(
            [
                kquant.kquant_linear(x, torch.cat([parts[0].data, parts[1].data]), kquant.Q4_K),
                kquant.kquant_linear(x, parts[2].data, kquant.Q6_K),
            ],
            dim=-1,
        )
        + layer.bias
    )
    assert torch.equal(layer(x), want)


@needs_kernels
def test_linear_keeps_one_kind_as_one_buffer():
    layer, parts = _qkv([kquant.Q6_K] * 3)
    layer.finalize_weights("auto", kernels_ready=True)
    assert layer.bits == kquant.Q6_K
    assert torch.equal(layer.qweight, torch.cat([p.data for p in parts]))


@pytest.mark.parametrize("mode,ready", [("none", True), ("auto", False)])
def test_linear_dequantizes_without_kernels_or_in_mode_none(mode, ready):
    layer, parts = _qkv([kquant.Q4_K, kquant.Q4_K, kquant.Q6_K])
    layer.finalize_weights(mode, kernels_ready=ready)
    assert layer.bits == 0
    want = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(layer.weight, want)


def _isas() -> list[str]:
    return ["avx2", "avx512"] if cpu.has_avx512() else ["avx2"]


def test_row_parallel_shard_that_splits_a_block_keeps_floats():
    weight = KQuantTensor(random_blocks(16, 1024, kquant.Q4_K), kquant.Q4_K)
    layer = RowParallelLinear(1024, 16, ParallelState(1, 2), shard=(384, 384))
    layer.load("weight", weight)
    layer.finalize_weights("auto", kernels_ready=True)
    assert layer.bits == 0
    assert torch.equal(layer.weight, weight.dequantize()[:, 384:768])
