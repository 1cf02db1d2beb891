"""The one place agentx reads ``AGENTX_*`` environment variables.

Every variable has one small function here; the rest of the code calls the function and never
touches ``os.environ`` itself, so the list below is the complete list. The functions read the
environment each time they are called, not at import; but ``AGENTX_KERNELS`` takes effect once,
when ``agentx.kernels`` is imported (the kernel dispatch is fixed for the process), while the
folders are looked up by each caller when it needs them.

Variables:
    AGENTX_CACHE_DIR   root folder for files agentx derives and keeps between runs (built
                       tokenizers, ...); default ``~/.cache/agentx``.
    AGENTX_KERNELS     kernel backend: ``auto`` (default), ``ref``, ``cpu`` or ``triton``.
    AGENTX_CPU_ISA     caps the vector instructions: ``auto`` (default: the best the CPU has),
                       ``avx2``, ``avx512`` or ``amx`` (AVX-512 and AMX int8 tiles for the
                       K-quant GEMM). It picks agentx's compiled kernels' variant and,
                       unless ``ATEN_CPU_CAPABILITY`` is set, torch's own (read when torch
                       loads), so an AVX-512 machine runs what an AVX2-only machine runs.
    AGENTX_SPIN_US     microseconds a thread of the CPU kernels' team spins for the next loop
                       before it sleeps (``kernels/cpu/csrc/parallel.h``); default 2000, 0
                       sleeps at once. Read when the kernels load.
    AGENTX_PEERS_DIR   peer engines' venvs and converted models (``benchmarks/peers``), used by
                       ``agentx bench``; default ``~/.cache/agentx/peers``.

Two variables are set rather than read: ``OMP_WAIT_POLICY`` defaults to ``PASSIVE`` when agentx is
imported before torch (see :func:`apply_cpu_defaults`), and ``GLOO_SOCKET_IFNAME`` to ``lo`` in
parallel worker processes (:func:`pin_gloo_to_loopback`). The vLLM backend sets vLLM's own
variables (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the CPU ones) through
:func:`set_vllm_environment`, and puts back what vLLM's start changed besides them
(:func:`restore_environment`).
"""

from __future__ import annotations

import os
from pathlib import Path

from agentx.errors import ConfigError

__all__ = [
    "apply_cpu_defaults",
    "cache_dir",
    "cpu_isa",
    "environ_snapshot",
    "kernel_backend",
    "peers_dir",
    "pin_gloo_to_loopback",
    "restore_environment",
    "set_vllm_environment",
    "spin_us",
]

_KERNEL_BACKENDS = ("auto", "ref", "cpu", "triton")
_CPU_ISAS = ("auto", "avx2", "avx512", "amx")


def cache_dir() -> Path:
    """The cache root: ``$AGENTX_CACHE_DIR`` if set and not empty, else ``~/.cache/agentx``.

    The folder is not created here; writers create what they need under it.
    """
    value = os.environ.get("AGENTX_CACHE_DIR", "").strip()
    if value:
        return Path(value).expanduser()
    return Path.home() / ".cache" / "agentx"


def peers_dir() -> Path:
    """``$AGENTX_PEERS_DIR`` if set and not empty, else ``~/.cache/agentx/peers``."""
    value = os.environ.get("AGENTX_PEERS_DIR", "").strip()
    if value:
        return Path(value).expanduser()
    return Path.home() / ".cache" / "agentx" / "peers"


def kernel_backend() -> str:
    """``$AGENTX_KERNELS`` lower-cased, ``auto`` when unset; anything else raises ConfigError."""
    value = os.environ.get("AGENTX_KERNELS", "").strip().lower() or "auto"
    if value not in _KERNEL_BACKENDS:
        choices = ", ".join(_KERNEL_BACKENDS)
        raise ConfigError(f"AGENTX_KERNELS={value!r}: expected one of {choices}")
    return value


def cpu_isa() -> str:
    """``$AGENTX_CPU_ISA`` lower-cased, ``auto`` when unset; anything else raises ConfigError."""
    value = os.environ.get("AGENTX_CPU_ISA", "").strip().lower() or "auto"
    if value not in _CPU_ISAS:
        raise ConfigError(f"AGENTX_CPU_ISA={value!r}: expected one of {', '.join(_CPU_ISAS)}")
    return value


def spin_us() -> int:
    """``$AGENTX_SPIN_US`` as whole microseconds >= 0 (default 2000); else ConfigError."""
    raw = os.environ.get("AGENTX_SPIN_US", "").strip()
    if not raw:
        return 2000
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"AGENTX_SPIN_US={raw!r}: expected whole microseconds >= 0")
    return value


def apply_cpu_defaults() -> None:
    """Default ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a policy (``OMP_WAIT_POLICY``,
    or libgomp's ``GOMP_SPINCOUNT``, a bounded spin before sleeping).

    With few cores and a busy machine, OpenMP threads that spin between small matmuls stall the
    engine loop. OpenMP reads the variable when torch loads it, so this only takes effect when
    agentx is imported before torch; ``make`` and the tests export it as well.
    """
    if "GOMP_SPINCOUNT" not in os.environ:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    isa = cpu_isa()
    if isa != "auto":  # torch's dispatch reads it once, when it loads (AMX: its AVX-512 code)
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx512" if isa == "amx" else isa)


def pin_gloo_to_loopback() -> None:
    """Default ``GLOO_SOCKET_IFNAME=lo`` in a worker process, unless the user chose an
    interface: agentx's ranks share one machine, and gloo would otherwise bind the interface
    the host name resolves to (none at all inside a private network namespace)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def environ_snapshot() -> dict[str, str]:
    """A copy of the whole environment (the vLLM backend compares it around vLLM's start)."""
    return dict(os.environ)


def set_vllm_environment(values: dict[str, str], forced: tuple[str, ...] = ()) -> None:
    """Set vLLM's variables before it is imported: ``values`` as defaults the user's own
    settings override, except the names in ``forced`` (the backend needs those as given)."""
    for name, value in values.items():
        if name in forced:
            os.environ[name] = value
        else:
            os.environ.setdefault(name, value)


def restore_environment(snapshot: dict[str, str], keep_prefixes: tuple[str, ...]) -> list[str]:
    """Put back every variable changed since ``snapshot`` except those whose names start with
    one of ``keep_prefixes``; returns the names put back."""
    changed = [
        name
        for name in set(snapshot) | set(os.environ)
        if snapshot.get(name) != os.environ.get(name) and not name.startswith(keep_prefixes)
    ]
    for name in changed:
        if name in snapshot:
            os.environ[name] = snapshot[name]
        else:
            del os.environ[name]
    return sorted(changed)
