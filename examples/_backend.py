"""``--backend`` for the examples: agentx's own engine (the default) or the vLLM backend.

    python examples/quickstart.py --backend vllm     # needs vllm (`pip install 'agentx[vllm]'`)

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


@contextlib.contextmanager
def open_engine(backend: str) -> Iterator[object | None]:
    """The engine for ``backend``; None means the process-wide default agentx engine."""
    if backend == "agentx":
        yield None
        return
    from agentx.engine.vllm import VLLMEngine

    engine = VLLMEngine()
    try:
        yield engine
    finally:
        engine.close()
