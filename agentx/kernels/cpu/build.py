"""Build and load the C++ CPU kernels (``csrc/*.cpp``) as the ``torch.ops.agentx`` library.

The sources compile once per installation into ``agentx/kernels/cpu/_build/<hash>/`` (or
``<AGENTX_CACHE_DIR>/kernels/<hash>/`` when the package folder is read-only; the hash covers the
sources, the flags and the torch version, so an edit or an upgrade rebuilds) with torch's C++
extension builder; later processes only load the shared library. ``make`` builds it at
install (``python -m agentx.kernels.cpu``). The kernels need AVX2 and FMA (their AVX-512 VNNI
versions are compiled alongside with per-function target attributes and chosen at run time where
the CPU has them, see ``kernel_isa``): elsewhere, or when the build fails, :func:`load`
returns False and callers use the reference kernels.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from agentx import env
from agentx.errors import ConfigError

__all__ = ["available", "load"]

_SOURCES = (
    "qlinear.cpp",
    "qlinear_avx512.cpp",
    "qlinear_kquant.cpp",
    "qlinear_kquant_avx512.cpp",
    "paged_attention.cpp",
    "kv_int8.cpp",
    "decoder_layer.cpp",
)
# -fopenmp: at::parallel_for is a header template around `#pragma omp parallel`; without the
# flag it compiles to a serial loop (every kernel on one thread). The library links the
# libgomp.so.1 that torch already loaded, so both share one OpenMP thread pool.
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fno-math-errno", "-fopenmp")
_CSRC = Path(__file__).with_name("csrc")
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, bool] = {}


def _cpu_supported() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _build_dir() -> Path:
    digest = hashlib.sha256()
    for path in sorted(_CSRC.iterdir()):  # sources and headers
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(_FLAGS).encode())
    digest.update(torch.__version__.encode())
    name = digest.hexdigest()[:16]
    beside = Path(__file__).with_name("_build")
    if os.access(beside if beside.exists() else beside.parent, os.W_OK):
        return beside / name
    return env.cache_dir() / "kernels" / name


def load(verbose: bool = False) -> bool:
    """Build (first time) and load the library; True when ``torch.ops.agentx`` has the ops."""
    if "ok" in _state:  # every linear and attention call asks: answer without the lock
        return _state["ok"]
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _cpu_supported() and _build_and_load(verbose) and _cap_isa()
        return _state["ok"]


def available() -> bool:
    """Whether the compiled CPU kernels are usable here (builds them on first call)."""
    return load()


def _build_and_load(verbose: bool) -> bool:
    build_dir = _build_dir()
    library = build_dir / "agentx_cpu_kernels.so"
    try:
        if library.exists():
            torch.ops.load_library(str(library))
            return True
        from torch.utils import cpp_extension  # noqa: PLC0415 (slow import, build only)

        build_dir.mkdir(parents=True, exist_ok=True)
        with _exclusive(build_dir / "agentx.lock"):
            if not library.exists():  # another process may have built it while we waited
                # torch's own lock file, left behind by a build that was killed (Ctrl-C on the
                # first import): torch would wait on it forever. Holding our lock, no live
                # agentx build owns it.
                (build_dir / "lock").unlink(missing_ok=True)
                _log.warning("agentx: compiling CPU kernels once into %s (~1 minute)", build_dir)
                cpp_extension.load(
                    name="agentx_cpu_kernels",
                    sources=[str(_CSRC / name) for name in _SOURCES],
                    extra_cflags=list(_FLAGS),
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir),
                    is_python_module=False,
                    verbose=verbose,
                )
        if str(library) not in torch.ops.loaded_libraries:
            torch.ops.load_library(str(library))
        return True
    except Exception as exc:  # a missing compiler, a failed build: fall back, loudly
        _log.warning("agentx: CPU kernels unavailable (%s); using reference kernels", exc)
        return False


def _cap_isa() -> bool:
    """Apply ``AGENTX_CPU_ISA`` to the kernels' run-time dispatch (0: AVX2, 1: AVX-512 VNNI);
    a cap above what the CPU runs is a ConfigError."""
    isa = env.cpu_isa()
    if isa != "auto":
        wanted = ("avx2", "avx512").index(isa)
        if torch.ops.agentx.kernel_isa(wanted) != wanted:
            raise ConfigError(f"AGENTX_CPU_ISA={isa}: this CPU cannot run those kernels")
    return True


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An advisory lock between processes building into one folder (released if one dies)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def main() -> None:
    ok = load(verbose=True)
    print(f"agentx CPU kernels: {'ready' if ok else 'unavailable'} in {_build_dir()}")
