"""Where the compiled CPU kernels build (the cache folder, never the package), how loudly a
fallback to the reference kernels is reported (a logged warning and a KernelFallbackWarning,
once per process), the active kernels logged once at start, and the thread-local scratch arena
(no allocation per call in steady state)."""

import logging
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

import agentx
from agentx import kernels
from agentx.errors import KernelFallbackWarning
from agentx.kernels import cpu
from agentx.kernels.cpu import build
from agentx.kernels.ref import quant as ref_quant

PACKAGE = Path(agentx.__file__).parent
ROOT = PACKAGE.parent


def test_build_dir_is_in_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTX_CACHE_DIR", str(tmp_path))
    folder = build.get_build_dir()
    assert folder.parent == tmp_path / "kernels"
    assert len(folder.name) == 16 and int(folder.name, 16) >= 0  # the sources' hash
    monkeypatch.delenv("AGENTX_CACHE_DIR")
    default = build.get_build_dir()
    assert default == Path.home() / ".cache" / "agentx" / "kernels" / folder.name
    assert PACKAGE not in default.parents


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """The loader as in a new process (nothing loaded, nothing reported), building into an
    empty folder."""
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "_build_dir", lambda: tmp_path / "kernels")
    return tmp_path / "kernels"


def _load_and_catch() -> tuple[bool, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = build.load()
    return ok, [w for w in caught if issubclass(w.category, KernelFallbackWarning)]


def test_failed_build_warns_once_per_process(fresh_build, monkeypatch, caplog):
    def failing_build(**kwargs):
        raise RuntimeError("error: ninja build stopped")

    monkeypatch.setattr(cpp_extension, "load", failing_build)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        ok, caught = _load_and_catch()
    assert not ok
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "the build failed: error: ninja build stopped" in message
    assert "reference kernels" in message
    assert [r.levelno for r in caplog.records if "unavailable" in r.message] == [logging.WARNING]
    # answered from the first try after that; and a retry still warns no more
    assert _load_and_catch() == (False, [])
    del build._state["ok"]
    assert _load_and_catch() == (False, [])


def test_missing_compiler_warns_before_building(fresh_build, monkeypatch):
    monkeypatch.setenv("CXX", "agentx-no-such-compiler")
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: pytest.fail("built anyway"))
    ok, caught = _load_and_catch()
    assert not ok and len(caught) == 1
    assert "no C++ compiler ('agentx-no-such-compiler' is not on PATH)" in str(caught[0].message)
    assert not fresh_build.exists()  # nothing written


def test_cpu_without_avx2_warns(fresh_build, monkeypatch):
    monkeypatch.setattr(build, "_cpu_supported", lambda: False)
    ok, caught = _load_and_catch()
    assert not ok and len(caught) == 1
    assert "this CPU has no AVX2 and FMA" in str(caught[0].message)


def test_fallback_shows_at_engine_start_in_a_new_process(tmp_path):
    """A fresh process without a compiler: preparing the kernels (what the engine does at
    start) warns once, logs the reference backend, and the ops still run (on the reference)."""
    code = (
        "import logging, warnings\n"
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
        "warnings.simplefilter('always')\n"
        "import torch\n"
        "from agentx import kernels\n"
        "from agentx.kernels.ref import quant\n"
        "print(kernels.prepare(), kernels.prepare())\n"
        "w = quant.pack_weight(*quant.quantize_weight(torch.ones(8, 32), 8), 8)\n"
        "print(kernels.quantized_linear(torch.ones(1, 32), *w, None, 8).sum().item())\n"
    )
    env = dict(os.environ, AGENTX_CACHE_DIR=str(tmp_path), CXX="agentx-no-such-compiler")
    env.pop("AGENTX_KERNELS", None)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=ROOT,
        env=env,
    )
    out = proc.stdout.splitlines()
    assert out[0] == "False False"
    assert float(out[1]) == pytest.approx(256.0, rel=1e-3)
    assert proc.stderr.count("KernelFallbackWarning") == 1
    assert proc.stderr.count("WARNING agentx: the compiled CPU kernels are unavailable") == 1
    assert proc.stderr.count("INFO agentx kernels: backend ref, ISA none, build none") == 1


needs_kernels = pytest.mark.skipif(
    not cpu.available(), reason="the compiled CPU kernels need an AVX2 CPU and a C++ compiler"
)


@needs_kernels
@pytest.mark.skipif(
    kernels.BACKEND == "triton", reason="AGENTX_KERNELS=triton sends CPU tensors' ops to Triton"
)
def test_active_kernels_logged_once_at_start(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_logged", [])
    serve = kernels.BACKEND != "ref"  # AGENTX_KERNELS=ref: built, but the reference serves
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        assert kernels.prepare() == serve and kernels.prepare() == serve
    active = kernels.get_active_kernels()
    if serve:
        assert active == kernels.ActiveKernels("cpu", None, cpu.get_isa(), build.get_build_dir())
    else:
        assert active == kernels.ActiveKernels("ref", None, None, None)
    assert [r.getMessage() for r in caplog.records] == [
        f"agentx kernels: backend {active.backend}, ISA {active.isa or 'none'}, "
        f"build {active.build_dir or 'none'}"
    ]


@needs_kernels
def test_engine_on_another_device_builds_nothing_and_logs_ref(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_logged", [])
    monkeypatch.setattr(build, "_state", {})  # a load would show as "ok" here
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        assert not kernels.prepare(cpu=False)
    assert "ok" not in build._state
    assert [r.getMessage() for r in caplog.records] == [
        "agentx kernels: backend ref, ISA none, build none"
    ]


def _linear_inputs(m: int, k: int = 64, n: int = 32, bits: int = 4):
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    weight = torch.randn(n, k, generator=gen)
    packed = ref_quant.pack_weight(*ref_quant.quantize_weight(weight, bits), bits)
    return x, packed


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_scratch_arena_allocates_nothing_in_steady_state(bits):
    """The linear kernel's scratch (quantized activations) comes from its thread's arena: the
    first call of a shape grows it, the same shape again allocates nothing, a smaller one fits,
    and the results are the same bits every time. A new thread starts with an empty arena."""
    x, packed = _linear_inputs(37, bits=bits)
    small, small_packed = _linear_inputs(3, bits=bits)
    big, big_packed = _linear_inputs(300, bits=bits)
    stats: dict[str, list[int]] = {}
    results: list[torch.Tensor] = []

    def calls() -> None:
        stats["start"] = torch.ops.agentx.scratch_stats()
        for _ in range(3):
            results.append(cpu.quantized_linear(x, *packed, None, bits))
            stats.setdefault("first", torch.ops.agentx.scratch_stats())
        cpu.quantized_linear(small, *small_packed, None, bits)
        stats["steady"] = torch.ops.agentx.scratch_stats()
        results.append(cpu.quantized_linear(big, *big_packed, None, bits))
        stats["grown"] = torch.ops.agentx.scratch_stats()
        results.append(cpu.quantized_linear(big, *big_packed, None, bits))
        stats["grown_steady"] = torch.ops.agentx.scratch_stats()

    thread = threading.Thread(target=calls)
    thread.start()
    thread.join()
    assert stats["start"] == [0, 0]
    held, allocations = stats["first"]
    assert held >= 37 * 64 + 2 * 37 * 2 * 4  # int8 activations, two floats a row and group
    assert allocations > 0
    assert stats["steady"] == [held, allocations]
    grown, more = stats["grown"]
    assert grown >= 300 * 64 and more > allocations
    assert stats["grown_steady"] == [grown, more]
    assert all(torch.equal(r, results[0]) for r in results[1:3])
    assert torch.equal(results[3], results[4])
    assert torch.equal(results[0], cpu.quantized_linear(x, *packed, None, bits))  # this thread


def _tiny_layer(rows: int, bits: int = 4):
    """A one-head fused layer (hidden 64, head_dim 64, inter 64) over a one-block cache: the
    op's arguments for ``rows`` tokens at positions 0..rows-1 of one request."""
    gen = torch.Generator().manual_seed(rows)
    hidden = head_dim = inter = 64

    def linear(out_features: int, in_features: int) -> cpu.FusedLinear:
        weight = torch.randn(out_features, in_features, generator=gen) * 0.1
        return cpu.FusedLinear(
            *ref_quant.pack_weight(*ref_quant.quantize_weight(weight, bits), bits), bits
        )

    weights = cpu.FusedLayerWeights.with_qkv_runs(
        [linear(3 * head_dim, hidden)],
        None,
        input_norm=torch.ones(hidden),
        o_proj=linear(hidden, head_dim),
        post_attention_norm=torch.ones(hidden),
        gate_up_proj=linear(2 * inter, hidden),
        down_proj=linear(hidden, inter),
    )
    positions = torch.arange(rows)
    angles = torch.arange(16)[:, None] * torch.rand(head_dim // 2, generator=gen)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return (
        torch.randn(rows, hidden, generator=gen),
        positions,
        cos_sin,
        weights,
        torch.zeros(1, 2, 16, 1, head_dim),
        positions.clone(),  # slots 0..rows-1 of block 0
        torch.zeros(1, 1, dtype=torch.long),
        torch.zeros(rows, dtype=torch.long),
        positions + 1,
        1,
        1e-6,
        head_dim**-0.5,
        None,
    )


@needs_kernels
def test_fused_layer_nests_its_linears_scratch_without_allocating_again():
    """The fused layer holds its intermediate rows in a scratch frame while each projection
    takes its own inside it: after the first call, the same call allocates nothing and gives
    the same bits."""
    args = _tiny_layer(rows=5)
    stats: list[list[int]] = []
    outs: list[torch.Tensor] = []

    def calls() -> None:
        for _ in range(3):
            outs.append(cpu.fused_decoder_layer(*args))
            stats.append(torch.ops.agentx.scratch_stats())

    thread = threading.Thread(target=calls)
    thread.start()
    thread.join()
    held, allocations = stats[0]
    assert held >= 5 * 64 * 4 * 6  # six float buffers of at least 64 floats a row
    assert stats[1] == stats[2] == [held, allocations]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
