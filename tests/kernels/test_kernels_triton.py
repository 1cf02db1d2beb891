"""The Triton backend on CPU: its kernels under the interpreter (``tests/kernels/triton_cases.py``,
in a
child pytest so ``TRITON_INTERPRET=1`` reaches nothing else) and the dispatch's choice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton comes with the dev extra; not installed here")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("AGENTX_KERNELS",)}
    environ.update(env)
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow  # every kernel under the Triton interpreter: tens of seconds
def test_triton_kernels_match_ref_under_interpreter():
    proc = _run(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "triton_cases.py")],
        TRITON_INTERPRET="1",
        AGENTX_KERNELS="triton",
    )
    assert proc.returncode == 0, proc.stdout[-12000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout.splitlines()[-1]


def test_auto_on_cpu_keeps_the_reference_and_never_imports_triton():
    check = (
        "import sys; import agentx.kernels as k; from agentx.kernels import ref; "
        "assert k.BACKEND == 'auto' and not k.triton_enabled(); "
        "assert k.rms_norm is ref.rms_norm and k.write_kv is ref.write_kv; "
        "assert 'triton' not in sys.modules, 'triton imported'"
    )
    proc = _run(["-c", check])
    assert proc.returncode == 0, proc.stderr[-4000:]
