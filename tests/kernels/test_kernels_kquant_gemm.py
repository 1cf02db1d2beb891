"""The K-quant GEMMs (many rows, qlinear_kquant_gemm.cpp, _avx512.cpp and _amx.cpp) give the
row-group path's bits.

From kKquantGemmRows (32; 16 on AVX-512 and AMX) rows on, each ISA's GEMM runs every weight
super-block once against all rows; fewer rows take the row groups of <= 4. Since the row-group
path's rows are independent, each GEMM row must equal the same rows run in groups of 4 and the
reference, bit for bit, on every ISA this CPU runs, on awkward widths (a partial 8- or 16-column
group, a partial 32- or 48-column tile, AMX's short last tile of rows), with 1 and 2 threads,
and on the extreme weight and activation values where a 16-bit intermediate (or an AMX piece
of a scale times a weight) could overflow.
"""

import pytest
import torch

from agentx.kernels import cpu
from agentx.kernels.ref import kquant
from tests.helpers.kquant import random_blocks

needs_kernels = pytest.mark.skipif(
    not cpu.available(), reason="the compiled CPU kernels need an AVX2 CPU and a C++ compiler"
)
KINDS = [kquant.Q4_K, kquant.Q6_K]
ISAS = cpu.isas() if cpu.available() else ["avx2"]
ROWS = (1, 5, 8, 9, 16, 17, 33, 35, 64, 130, 300)  # 300: two passes of 256 rows over a tile


def _in_groups_of_4(x: torch.Tensor, w: torch.Tensor, kind: int) -> torch.Tensor:
    op = torch.ops.agentx.kquant_linear
    return torch.cat([op(x[r : r + 4], w, kind, None) for r in range(0, x.shape[0], 4)])


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(45, 768), (70, 2560), (100, 512)])
def test_gemm_equals_row_groups_and_reference(kind, n, k, threads, isa):
    w = random_blocks(n, k, kind, seed=n)
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(k)) * 3
    with cpu.use_isa(isa):
        for m in ROWS:
            got = torch.ops.agentx.kquant_linear(x[:m], w, kind, None)
            assert torch.equal(got, _in_groups_of_4(x[:m], w, kind)), m
            assert torch.equal(got, kquant.kquant_linear(x[:m], w, kind)), m


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
def test_gemm_extreme_values_stay_exact(kind, isa):
    n, k = 50, 512  # 3 whole 16-column groups and a partial one
    w = torch.full((n, k // kquant.BLOCK, kquant.block_bytes(kind)), 0xFF, dtype=torch.uint8)
    d = torch.tensor([1e-3], dtype=torch.float16).view(torch.uint8)
    if kind == kquant.Q4_K:  # every nibble 15, every 6-bit scale and min 63
        w[..., 0:2], w[..., 2:4] = d, d
    else:  # every 6-bit weight 63; scales -128 and 127 alternate (int8)
        w[..., 192:208] = torch.tensor([0x80, 0x7F] * 8, dtype=torch.uint8)
        w[..., 208:210] = d
    w = w.reshape(n, -1)
    x = torch.ones(40, k)  # >= 32 rows: the GEMM
    x[1::2] = -1.0  # xq all 127 or all -127
    x[2, ::3] = -1.0  # mixed signs
    with cpu.use_isa(isa):
        got = torch.ops.agentx.kquant_linear(x, w, kind, None)
        assert torch.equal(got, _in_groups_of_4(x, w, kind))
    assert torch.equal(got, kquant.kquant_linear(x, w, kind))
    # every output is the largest magnitude these blocks can give: none saturated on the way
    assert torch.equal(got[0], got[1].neg())
