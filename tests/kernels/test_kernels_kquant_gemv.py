"""The K-quant kernel's few-row path (decode and drafts: M <= 4 rows a pass, 8 columns a group,
a remainder column by column) gives the reference's bits on awkward shapes.

N is not a multiple of 8 or 16 (groups of 8 plus remainders, a last partial 16-column chunk),
M runs 1..9 (row groups of 4, 3, 2, 1 and the rows past them), the result does not depend on
the thread count, a row alone equals that row in a batch, the per-thread activation buffers are
reused across calls of different sizes without stale data, and an ``AGENTX_CPU_ISA=avx2``
process gives the same bits.
"""

import os
import subprocess
import sys

import pytest
import torch

from agentx.kernels import cpu
from agentx.kernels.ref import kquant
from tests.helpers.kquant import random_blocks

pytestmark = pytest.mark.skipif(
    not cpu.available(), reason="the compiled CPU kernels need an AVX2 CPU and a C++ compiler"
)
KINDS = [kquant.Q4_K, kquant.Q6_K]


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3


def _isas() -> list[str]:
    return ["avx2", "avx512"] if cpu.has_avx512() else ["avx2"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(1, 256), (7, 512), (8, 256), (23, 1536), (41, 768)])
def test_rows_one_to_nine_equal_reference_bit_for_bit(kind, n, k):
    w = random_blocks(n, k, kind, seed=n)
    for m in range(1, 10):
        x = _x(m, k, seed=m)
        want = kquant.kquant_linear(x, w, kind, None)
        for isa in _isas():
            with cpu.use_isa(isa):
                got = torch.ops.agentx.kquant_linear(x, w, kind, None)
            assert torch.equal(got, want), (m, isa)


@pytest.mark.parametrize("kind", KINDS)
def test_threads_one_and_two_give_the_same_bits(kind):
    w = random_blocks(200, 2560, kind, seed=3)  # 12 full 16-column chunks and 8 columns more
    x = _x(4, 2560, seed=4)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append([torch.ops.agentx.kquant_linear(x[:m], w, kind, None) for m in (1, 2, 4)])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(outs[0], outs[1], strict=True):
        assert torch.equal(one, two)
    assert torch.equal(outs[0][0][0], outs[0][2][0])  # row 0 alone == row 0 of four
    assert torch.equal(outs[0][0], kquant.kquant_linear(x[:1], w, kind, None))


def test_reused_buffers_hold_no_stale_rows():
    # a large call (K = 35 blocks), then smaller K and fewer rows: the per-thread buffers only
    # grow, and a smaller call must read its own activations, not the previous call's
    big = random_blocks(19, 8960, kquant.Q6_K, seed=5)
    small = random_blocks(19, 512, kquant.Q4_K, seed=6)
    calls = [(big, kquant.Q6_K, 4, 8960), (small, kquant.Q4_K, 1, 512), (big, kquant.Q6_K, 1, 8960)]
    calls += [(small, kquant.Q4_K, 7, 512), (small, kquant.Q4_K, 2, 512)]
    for i, (w, kind, m, k) in enumerate(calls):
        x = _x(m, k, seed=10 + i)
        got = torch.ops.agentx.kquant_linear(x, w, kind, None)
        assert torch.equal(got, kquant.kquant_linear(x, w, kind, None)), i


CAPPED = """
import torch
from tests.helpers.kquant import random_blocks
from agentx.kernels import cpu
from agentx.kernels.ref import kquant
assert cpu.available() and cpu.get_isa() == "avx2"
for kind in (kquant.Q4_K, kquant.Q6_K):
    w = random_blocks(29, 1536, kind, seed=kind)
    for m in (1, 2, 3, 5):
        x = torch.randn(m, 1536, generator=torch.Generator().manual_seed(m)) * 3
        got = torch.ops.agentx.kquant_linear(x, w, kind, None)
        assert torch.equal(got, kquant.kquant_linear(x, w, kind, None)), (kind, m)
print("ok")
"""


def test_avx2_capped_process_gives_reference_bits():
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env["AGENTX_CPU_ISA"] = "avx2"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", CAPPED], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok"]
