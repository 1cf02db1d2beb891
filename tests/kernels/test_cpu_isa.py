"""``AGENTX_CPU_ISA`` caps the vector instructions, so one machine runs the suite as another
would: agentx's compiled kernels and torch's own dispatch both (checked in a fresh process,
since torch reads ``ATEN_CPU_CAPABILITY`` once, when it loads)."""

import os
import subprocess
import sys

import pytest

PROBE = (
    "import agentx, torch\n"
    "from agentx.kernels import cpu\n"
    "assert cpu.available()\n"
    "print(cpu.get_isa(), torch.backends.cpu.get_cpu_capability())\n"
)


def _run(isa: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env["AGENTX_CPU_ISA"] = isa
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )


def test_avx2_cap_reaches_agentx_kernels_and_torch():
    done = _run("avx2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["avx2", "AVX2"]


def test_unknown_isa_is_a_config_error():
    done = _run("sse9")
    assert done.returncode != 0
    assert "AGENTX_CPU_ISA='sse9'" in done.stderr and "ConfigError" in done.stderr


def test_avx512_cap_runs_or_says_the_cpu_cannot():
    from agentx.kernels import cpu

    if not cpu.available():
        pytest.skip("the compiled CPU kernels are not built here (no AVX2 / compiler)")
    done = _run("avx512")
    if cpu.has_avx512():
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[0] == "avx512"
    else:
        assert done.returncode != 0
        assert "this CPU cannot run those kernels" in done.stderr


def test_amx_cap_runs_or_says_the_cpu_cannot():
    from agentx.kernels import cpu

    if not cpu.available():
        pytest.skip("the compiled CPU kernels are not built here (no AVX2 / compiler)")
    done = _run("amx")
    if cpu.has_amx():  # torch's own dispatch runs its AVX-512 code
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["amx", "AVX512"]
    else:
        assert done.returncode != 0
        assert "this CPU cannot run those kernels" in done.stderr
