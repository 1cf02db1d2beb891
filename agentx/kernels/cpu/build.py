"""Build and load the C++ CPU kernels (``csrc/*.cpp``) as the ``torch.ops.agentx`` library.

The sources compile once into ``<AGENTX_CACHE_DIR>/kernels/<hash>/`` (default
``~/.cache/agentx/kernels/``; never into the package folder; the hash covers the sources, the
flags and the torch version, so an edit or an upgrade rebuilds) with torch's C++ extension
builder, which needs a C++ compiler and ``ninja`` (a declared dependency); later processes only
load the shared library. ``make`` builds it at install (``python -m agentx.kernels.cpu``). The
kernels need AVX2 and FMA (their AVX-512 VNNI versions are compiled alongside with per-function
target attributes and chosen at run time where the CPU has them, see ``kernel_isa``):
elsewhere, or when the build fails, :func:`load` returns False and callers use the reference
kernels, several times slower, so the fallback is loud: a logged warning and a
:class:`~agentx.errors.KernelFallbackWarning`, once per process.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import shutil
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from agentx import env
from agentx.errors import ConfigError, KernelFallbackWarning

__all__ = ["available", "get_build_dir", "load"]

_SOURCES = (
    "qlinear.cpp",
    "qlinear_avx512.cpp",
    "qlinear_kquant.cpp",
    "qlinear_kquant_avx512.cpp",
    "qlinear_kquant_gemm.cpp",
    "qlinear_kquant_gemm_avx512.cpp",
    "qlinear_kquant_gemm_amx.cpp",
    "paged_attention.cpp",
    "kv_int8.cpp",
    "decoder_layer.cpp",
    "argmax.cpp",
    "parallel.cpp",
)
# -fopenmp: at::parallel_for is a header template around `#pragma omp parallel`; without the
# flag it compiles to a serial loop (every kernel on one thread). The library links the
# libgomp.so.1 that torch already loaded, so both share one OpenMP thread pool.
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fno-math-errno", "-fopenmp")
_CSRC = Path(__file__).with_name("csrc")
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, bool] = {}  # "ok": the library loaded; "warned": the fallback was reported


def _cpu_supported() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _build_dir() -> Path:
    digest = hashlib.sha256()
    for path in sorted(_CSRC.iterdir()):  # sources and headers
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(_FLAGS).encode())
    digest.update(torch.__version__.encode())
    return env.cache_dir() / "kernels" / digest.hexdigest()[:16]


def get_build_dir() -> Path:
    """The folder the library is (or would be) built into for these sources and this torch."""
    return _build_dir()


def load(verbose: bool = False) -> bool:
    """Build (first time) and load the library; True when ``torch.ops.agentx`` has the ops."""
    if "ok" in _state:  # every linear and attention call asks: answer without the lock
        return _state["ok"]
    with _lock:
        if "ok" not in _state:
            if not _cpu_supported():
                _fall_back("this CPU has no AVX2 and FMA")
                _state["ok"] = False
            else:
                _state["ok"] = _build_and_load(verbose) and _cap_isa() and _set_spin()
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

        missing = _missing_build_tool(cpp_extension)
        if missing is not None:
            _fall_back(missing)
            return False
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
    except Exception as exc:  # a failed build or load: fall back, loudly
        _fall_back(f"the build failed: {exc}")
        return False


def _missing_build_tool(cpp_extension) -> str | None:
    """What the builder lacks here (a C++ compiler, ninja), or None."""
    compiler = cpp_extension.get_cxx_compiler()  # $CXX, else c++
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _fall_back(reason: str) -> None:
    """Report, once per process, that the wanted compiled kernels fell back to the reference."""
    if _state.get("warned"):
        return
    _state["warned"] = True
    message = (
        f"agentx: the compiled CPU kernels are unavailable ({reason}); every op runs on the "
        "reference kernels, several times slower. Set AGENTX_KERNELS=ref to choose them "
        "without this warning."
    )
    _log.warning(message)
    warnings.warn(message, KernelFallbackWarning, stacklevel=2)


def _set_spin() -> bool:
    """Apply ``AGENTX_SPIN_US`` to the kernels' thread team (csrc/parallel.h)."""
    torch.ops.agentx.team_spin_us(env.spin_us())
    return True


def _cap_isa() -> bool:
    """Apply ``AGENTX_CPU_ISA`` to the kernels' run-time dispatch (0: AVX2, 1: AVX-512 VNNI,
    2: AMX); a cap above what the CPU runs is a ConfigError."""
    isa = env.cpu_isa()
    if isa != "auto":
        wanted = ("avx2", "avx512", "amx").index(isa)
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
    print(f"agentx CPU kernels: {'ready' if ok else 'unavailable'} in {get_build_dir()}")
