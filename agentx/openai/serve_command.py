"""``agentx serve``: the OpenAI API over HTTP, for tools that only speak HTTP.

    agentx serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY ...]

Flags follow vLLM's ``vllm serve`` where the two agree (``--served-model-name``,
``--api-key``, ``--allowed-origins``, ``--chat-template``, ``--max-model-len``,
``--quantization``). Before any model load it checks what would otherwise fail after one: the
model file exists and the port can be bound (the bound socket is handed to uvicorn); either
failure is one line on stderr and exit status 2, no traceback. While the model loads, a
progress line is logged every few seconds; once loaded, the model, its quantization, the
kernel ISA, the context length and the KV capacity in tokens.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
import time
from pathlib import Path

__all__ = ["build_parser", "serve_main"]

logger = logging.getLogger("agentx.serve")

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
GRACEFUL_SHUTDOWN_S = 5
PROGRESS_EVERY_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentx serve",
        description="Serve the OpenAI API (chat, completions, responses) on agentx.",
    )
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default SmolLM2-135M)")
    p.add_argument(
        "--served-model-name",
        "--model-name",
        nargs="+",
        default=["agentx"],
        help="the model names /v1/models lists and requests may name (default: agentx)",
    )
    p.add_argument(
        "--accept-any-model",
        action="store_true",
        help="answer a request whatever model it names (clients that hard-code one)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY'; repeat for several keys (one tenant each)",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        help="browser origins allowed cross-origin (CORS), e.g. http://localhost:3000, or *",
    )
    p.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=[],
        help="Host header values accepted besides loopback and --host (DNS rebinding guard)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body (default 8 MiB; larger ones get 413)",
    )
    p.add_argument("--chat-template", default=None, help="a Jinja file replacing the model's")
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache size (default 2)")
    p.add_argument(
        "--quantization",
        default="auto",
        choices=("none", "auto", "int8", "int4"),
        help="weights kept quantized (default auto, as Engine())",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    p.add_argument(
        "--max-held-conversations",
        type=int,
        default=64,
        help="replies whose KV is held for a client re-sending its history (default 64)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=1024,
        help="reply cap when a chat request sets none (default 1024)",
    )
    return p


class StartupError(Exception):
    """What keeps the server from starting, said in one line."""


def check_model(model: str | None) -> None:
    if model is None:
        from agentx.engine.models.loader import default_model_path
        from agentx.errors import AgentXError

        try:
            default_model_path()
        except AgentXError as exc:
            raise StartupError(str(exc)) from None
    elif not Path(model).expanduser().exists():
        raise StartupError(f"model file not found: {model}")


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket uvicorn will serve on, bound now so a busy port fails early."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).expanduser().read_text()
    except OSError as exc:
        raise StartupError(f"cannot read --chat-template {path}: {exc.strerror}") from None


class _LoadProgress:
    """Logs "still loading" every ``every_s`` seconds until stopped."""

    def __init__(self, what: str, every_s: float = PROGRESS_EVERY_S) -> None:
        self._what, self._every = what, every_s
        self._done = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="agentx-load-progress", daemon=True)

    def __enter__(self) -> _LoadProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(self._every):
            logger.info("loading %s ... %.0f s", self._what, time.monotonic() - self._start)


def log_engine(engine, model: str | None) -> None:
    config = engine.config
    stats = engine.stats()
    kv_tokens = stats.kv_num_blocks * config.cache.block_size
    try:
        from agentx.kernels.cpu import get_isa

        isa = get_isa()
    except Exception:  # no CPU kernels built (a GPU-only install): not worth failing over
        isa = "unknown"
    logger.info(
        "model %s | quantization %s | ISA %s | context %d tokens | KV capacity %d tokens",
        model or "SmolLM2-135M-Instruct (default)",
        config.quantization,
        isa,
        engine.max_model_len,
        kv_tokens,
    )


def serve_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        check_model(args.model)
        chat_template = read_chat_template(args.chat_template)
        sock = bind_socket(args.host, args.port)
    except StartupError as exc:
        print(f"agentx serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve(args, sock, chat_template)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, sock: socket.socket, chat_template: str | None) -> int:
    import uvicorn

    from agentx.config import CacheConfig, EngineConfig
    from agentx.engine.client import Engine
    from agentx.errors import AgentXError
    from agentx.openai.server import create_app
    from agentx.openai.service import ChatService

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("serving on %s without --api-key: anyone reaching it may use it", args.host)
    config = EngineConfig(
        model=args.model,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        cache=CacheConfig(kv_cache_bytes=int(args.kv_cache_gib * (1 << 30))),
    )
    try:
        with _LoadProgress(args.model or "the default model"):
            engine = Engine(config)
    except AgentXError as exc:
        print(f"agentx serve: error: {exc}", file=sys.stderr)
        return 2
    log_engine(engine, args.model)
    service = ChatService(
        engine,
        model_name=args.served_model_name[0],
        max_held_conversations=args.max_held_conversations,
        default_max_tokens=args.default_max_tokens,
        owns_engine=True,
        chat_template=chat_template,
    )
    app = create_app(
        service,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        served_model_names=args.served_model_name,
        accept_any_model=args.accept_any_model,
        host=args.host,
        allowed_hosts=args.allowed_hosts,
        allowed_origins=args.allowed_origins,
    )
    host, port = sock.getsockname()[:2]
    logger.info("serving on http://%s:%d/v1", host, port)
    config = uvicorn.Config(app, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        service.close()
    return 0
