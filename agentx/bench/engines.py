"""Engine specs: the names ``run --engine`` and ``compare --engines`` accept, and how each
becomes an :class:`EngineAdapter`.

    agentx          the agentx worker in a subprocess (``python -m agentx.bench.worker``): how
                    ``compare`` measures agentx, the same way as every peer
    agentx-inproc   the agentx engine in this process (no IPC; the default of ``run``)
    fake            the deterministic fake engine (tests, dry runs)
    NAME            a peer worker ``benchmarks/peers/NAME_worker.py`` (run with this Python)
    NAME=COMMAND    any worker command line; a leading ``*.py`` runs with this Python

Worker commands get ``--model PATH --threads N`` appended (the protocol's fixed flags).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentx.bench.adapter import EngineAdapter
from agentx.bench.prompts import TokenSpace

PEERS_DIR = Path("benchmarks") / "peers"


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What every engine of one benchmark shares."""

    model: str  # a path every engine can load
    threads: int
    kv_cache_gib: float = 2.0
    dtype: str = "float32"


def resolve_model(model: str | None) -> str:
    if model in (None, "", "default"):
        from agentx.engine.models.loader import default_model_path

        return str(default_model_path())
    return str(model)


def token_space_for_model(model: str) -> TokenSpace:
    """The model's vocabulary without its special tokens (from its own tokenizer)."""
    from agentx.engine.models.tokenizer import Tokenizer

    path = Path(model)
    tok = Tokenizer.from_hf_folder(path) if path.is_dir() else Tokenizer.from_gguf(path)
    added = tok.backend.get_added_tokens_decoder()
    special = {i for i, t in added.items() if t.special}
    return TokenSpace.for_vocab(tok.vocab_size, special)


def engine_name(spec: str) -> str:
    return spec.split("=", 1)[0]


def make_engine(spec: str, settings: EngineSettings) -> Callable[[], EngineAdapter]:
    """A factory: each call builds a fresh (unstarted) adapter, so every run starts cold."""
    name, _, command = spec.partition("=")
    if name == "fake" and not command:
        from agentx.bench.fake_engine import FakeEngine

        return lambda: FakeEngine(decode_s_per_token=0.002)
    if name == "agentx-inproc" and not command:
        from agentx.bench.agentx_engine import AgentxEngine, AgentxOptions

        options = AgentxOptions(
            model=settings.model,
            threads=settings.threads,
            dtype=settings.dtype,
            kv_cache_bytes=int(settings.kv_cache_gib * (1 << 30)),
        )
        return lambda: AgentxEngine(options)
    argv = _worker_argv(name, command, settings)
    from agentx.bench.worker_engine import WorkerEngine

    return lambda: WorkerEngine(name, argv)


def _worker_argv(name: str, command: str, settings: EngineSettings) -> list[str]:
    if command:
        argv = shlex.split(command)
        if argv[0].endswith(".py"):
            argv.insert(0, sys.executable)
    elif name == "agentx":
        argv = [
            sys.executable,
            "-m",
            "agentx.bench.worker",
            "--dtype",
            settings.dtype,
            "--kv-cache-gib",
            str(settings.kv_cache_gib),
        ]
    else:
        script = PEERS_DIR / f"{name}_worker.py"
        if not script.is_file():
            raise ValueError(
                f"unknown engine {name!r}: not agentx, agentx-inproc or fake, and no {script}; "
                "give a worker command as NAME=COMMAND"
            )
        argv = [sys.executable, str(script)]
    return [*argv, "--model", settings.model, "--threads", str(settings.threads)]
