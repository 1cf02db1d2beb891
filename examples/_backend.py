"""``--backend`` for the examples: agentx's own engine (the default) or the vLLM backend.

    python examples/quickstart.py --backend vllm     # needs vllm (`pip install 'agentx[vllm]'`)
    python examples/coding_agent.py --speculative off  # agentx without drafting from context

The Session code is the same on both; only the engine handed to ``Session(engine=...)`` differs.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

BACKENDS = ("agentx", "vllm")


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="agentx",
        help="the engine under the Session: agentx's own (default) or vLLM, in this process",
    )
    parser.add_argument(
        "--speculative",
        choices=("on", "off"),
        help="agentx's drafting from context (default: SpeculativeConfig's)",
    )
    parser.add_argument(
        "--model",
        help="agentx's model: a .gguf file or a Hugging Face folder (default: SmolLM2-135M)",
    )


@contextlib.contextmanager
def open_engine(
    backend: str, speculative: str | None = None, model: str | None = None
) -> Iterator[object | None]:
    """The engine for ``backend``; None means the process-wide default agentx engine."""
    if backend == "agentx" and speculative is None and model is None:
        yield None
        return
    if backend == "agentx":
        from agentx import Engine, EngineConfig, SpeculativeConfig

        drafting = SpeculativeConfig() if speculative is None else None
        drafting = drafting or SpeculativeConfig(enabled=speculative == "on")
        config = EngineConfig(model=model, speculative=drafting)
        with Engine(config) as engine:
            yield engine
        return
    if model is not None:
        raise SystemExit("--model picks agentx's model (the vLLM backend loads its own)")
    if speculative is not None:
        raise SystemExit("--speculative is agentx's engine's switch (not the vLLM backend's)")
    from agentx.engine.vllm import VLLMEngine

    engine = VLLMEngine()
    try:
        yield engine
    finally:
        engine.close()
