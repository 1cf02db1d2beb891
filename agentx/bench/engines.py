"""Engine specs: the names ``run --engine`` and ``compare --engines`` accept, and how each
becomes an :class:`EngineAdapter`.

    agentx          the agentx worker in a subprocess (``python -m agentx.bench.worker``): how
                    ``compare`` measures agentx, the same way as every peer
    agentx-inproc   the agentx engine in this process (no IPC; the default of ``run``)
    agentx-vllm     agentx's vLLM backend in a worker (``python -m agentx.bench.worker --backend
                    vllm``), run with ``.venv-vllm/bin/python`` when it exists (``make test``
                    builds it), so ``compare`` shows raw vLLM and agentx-on-vLLM on one trace
    fake            the deterministic fake engine (tests, dry runs)
    vllm-ngram      the vllm peer with vLLM's n-gram drafting from the prompt on
                    (``speculative_config={"method": "ngram", "num_speculative_tokens": 8,
                    "prompt_lookup_max": 4, "prompt_lookup_min": 2}``), like for like with
                    agentx's drafting from context (:data:`PEER_VARIANTS`)
    NAME            a peer worker ``benchmarks/peers/worker_NAME.py``, run with the peer's
                    venv ``$AGENTX_PEERS_DIR/NAME/bin/python`` (this Python if there is none)
    NAME=COMMAND    any worker command line; a leading ``*.py`` runs with this Python

Worker commands get ``--model PATH --threads N`` appended (the protocol's fixed flags) unless
the command already has them. A peer's model is ``--peer-model NAME=PATH`` when given; with the
default model, the copy ``benchmarks/peers`` converts for it (``$AGENTX_PEERS_DIR/models``: the
f32 GGUF for llamacpp, the HF folder for the others) when it exists; else the shared ``--model``.

Text prompts are tokenized by each adapter with its engine's own tokenizer: in-process engines
with their own, worker engines here in the driver with the tokenizer of the worker's model file
(:func:`model_encode`), so every engine gets the same text. ``EngineSettings.parallel`` (``tp``,
``dcp``, ``pcp``, ``ep``, ``dp``) reaches agentx's ``ParallelConfig`` (worker flags ``--tp``...).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agentx import env
from agentx.bench.adapter import EngineAdapter
from agentx.bench.prompts import TokenSpace
from agentx.bench.segments import Encode

PEERS_DIR = Path("benchmarks") / "peers"  # relative to the repository root (the cwd)
PEER_HF_FOLDER = "SmolLM2-135M-Instruct.Q4_1-hf"
PEER_GGUF = "SmolLM2-135M-Instruct.f32.gguf"
PARALLEL_DEGREES = ("tp", "dcp", "pcp", "ep", "dp")  # agentx's ParallelConfig fields
# a variant runs a peer's worker with extra flags: name -> (peer, flags)
PEER_VARIANTS = {
    "vllm-ngram": (
        "vllm",
        ("--speculative", "ngram", "--num-speculative-tokens", "8",
         "--prompt-lookup-max", "4", "--prompt-lookup-min", "2"),
    ),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What every engine of one benchmark shares."""

    model: str  # the model file (agentx, and peers without a model of their own)
    threads: int
    kv_cache_gib: float = 2.0
    dtype: str = "float32"
    max_num_batched_tokens: int = 2048  # agentx's step token budget (its prefill chunk)
    peer_models: dict[str, str] = field(default_factory=dict)  # engine name -> its model path
    default_model: bool = True  # ``model`` is agentx's embedded default
    parallel: dict[str, int] = field(default_factory=dict)  # agentx's degrees: tp, dcp, ...

    def __post_init__(self) -> None:
        unknown = set(self.parallel) - set(PARALLEL_DEGREES)
        if unknown:
            raise ValueError(f"unknown parallel degrees {sorted(unknown)}")

    def parallel_flags(self) -> list[str]:
        """The agentx worker's flags for the degrees that are not 1."""
        return [f for k, v in sorted(self.parallel.items()) if v != 1 for f in (f"--{k}", str(v))]

    def model_for(self, name: str) -> str:
        if name in self.peer_models:
            return self.peer_models[name]
        # agentx and its variants (``agentx-nospec=COMMAND``...) load agentx's own model file
        if self.default_model and not name.startswith("agentx"):
            models = env.peers_dir() / "models"
            converted = models / (PEER_GGUF if name == "llamacpp" else PEER_HF_FOLDER)
            if converted.exists():
                return str(converted)
        return self.model


def resolve_model(model: str | None) -> str:
    if model in (None, "", "default"):
        from agentx.engine.models.loader import default_model_path

        return str(default_model_path())
    from agentx.model_store import resolve  # a short name (``qwen2.5-coder-1.5b``) -> its file

    path = resolve(str(model))
    return str(path) if path is not None else str(model)


def _tokenizer(model: str):
    from agentx.engine.models.tokenizer import Tokenizer

    path = Path(model)
    return Tokenizer.from_hf_folder(path) if path.is_dir() else Tokenizer.from_gguf(path)


def model_encode(model: str) -> Encode:
    """Text -> ids with the tokenizer of ``model`` (loaded at the first call); an empty model
    (the fake engine's) gets :func:`~agentx.bench.fake_adapter.fake_encode`."""
    if not model:
        from agentx.bench.fake_adapter import fake_encode

        return fake_encode
    loaded = []

    def encode(text: str) -> list[int]:
        if not loaded:
            loaded.append(_tokenizer(model))
        return loaded[0].encode(text)

    return encode


def token_space_for_model(model: str) -> TokenSpace:
    """The model's vocabulary without its special tokens (from its own tokenizer)."""
    tok = _tokenizer(model)
    added = tok.backend.get_added_tokens_decoder()
    special = {i for i, t in added.items() if t.special}
    return TokenSpace.for_vocab(tok.vocab_size, special)


def engine_name(spec: str) -> str:
    return spec.split("=", 1)[0]


def make_engine(spec: str, settings: EngineSettings) -> Callable[[], EngineAdapter]:
    """A factory: each call builds a fresh (unstarted) adapter, so every run starts cold."""
    name, _, command = spec.partition("=")
    if name == "fake" and not command:
        from agentx.bench.fake_adapter import FakeAdapter

        return lambda: FakeAdapter(decode_s_per_token=0.002)
    if name == "agentx-inproc" and not command:
        from agentx.bench.agentx_adapter import AgentxAdapter, AgentxOptions

        options = AgentxOptions(
            model=settings.model,
            threads=settings.threads,
            dtype=settings.dtype,
            kv_cache_bytes=int(settings.kv_cache_gib * (1 << 30)),
            max_num_batched_tokens=settings.max_num_batched_tokens,
            parallel=dict(settings.parallel),
        )
        return lambda: AgentxAdapter(options)
    argv = _worker_argv(name, command, settings)
    from agentx.bench.worker_adapter import WorkerAdapter

    model = argv[argv.index("--model") + 1]
    encode = model_encode(model if name != "fake" else "")
    return lambda: WorkerAdapter(name, argv, encode=encode)


def _worker_argv(name: str, command: str, settings: EngineSettings) -> list[str]:
    if command:
        argv = shlex.split(command)
        if argv[0].endswith(".py"):
            argv.insert(0, sys.executable)
    elif name == "agentx":
        argv = [sys.executable, "-m", "agentx.bench.worker", "--dtype", settings.dtype,
                "--kv-cache-gib", str(settings.kv_cache_gib),
                "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
                *settings.parallel_flags()]  # fmt: skip
    elif name == "agentx-vllm":
        python = Path(".venv-vllm") / "bin" / "python"
        argv = [str(python) if python.exists() else sys.executable, "-m", "agentx.bench.worker",
                "--backend", "vllm", "--dtype", settings.dtype,
                "--kv-cache-gib", str(settings.kv_cache_gib),
                "--max-num-batched-tokens", str(settings.max_num_batched_tokens)]  # fmt: skip
    else:
        peer, flags = PEER_VARIANTS.get(name, (name, ()))
        script = PEERS_DIR / f"worker_{peer}.py"
        if not script.is_file():
            raise ValueError(
                f"unknown engine {name!r}: not agentx, agentx-inproc or fake, and no {script}; "
                "give a worker command as NAME=COMMAND"
            )
        python = env.peers_dir() / peer / "bin" / "python"
        argv = [str(python) if python.exists() else sys.executable, str(script), *flags]
    if "--model" not in argv:
        argv += ["--model", settings.model_for(name)]
    if "--threads" not in argv:
        argv += ["--threads", str(settings.threads)]
    return argv
