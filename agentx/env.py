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
    AGENTX_PEERS_DIR   peer engines' venvs and converted models (``benchmarks/peers``), used by
                       ``agentx bench``; default ``~/.cache/agentx/peers``.

Two variables are set rather than read: ``OMP_WAIT_POLICY`` defaults to ``PASSIVE`` when agentx is
imported before torch (see :func:`apply_cpu_defaults`), and ``GLOO_SOCKET_IFNAME`` to ``lo`` in
parallel worker processes (:func:`pin_gloo_to_loopback`).
"""

from __future__ import annotations

import os
from pathlib import Path

from agentx.errors import ConfigError

__all__ = [
    "apply_cpu_defaults",
    "cache_dir",
    "kernel_backend",
    "peers_dir",
    "pin_gloo_to_loopback",
]

_KERNEL_BACKENDS = ("auto", "ref", "cpu", "triton")


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


def apply_cpu_defaults() -> None:
    """Default ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a policy (``OMP_WAIT_POLICY``,
    or libgomp's ``GOMP_SPINCOUNT``, a bounded spin before sleeping).

    With few cores and a busy machine, OpenMP threads that spin between small matmuls stall the
    engine loop. OpenMP reads the variable when torch loads it, so this only takes effect when
    agentx is imported before torch; ``make`` and the tests export it as well.
    """
    if "GOMP_SPINCOUNT" not in os.environ:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pin_gloo_to_loopback() -> None:
    """Default ``GLOO_SOCKET_IFNAME=lo`` in a worker process, unless the user chose an
    interface: agentx's ranks share one machine, and gloo would otherwise bind the interface
    the host name resolves to (none at all inside a private network namespace)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
