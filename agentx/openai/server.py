"""``agentx serve``: the Chat Completions API over HTTP, for tools that only speak HTTP.

    agentx serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY]

One engine and one :class:`ChatService` serve every connection (requests from all clients
batch together in the engine, and a client's re-sent history continues its held
conversation). Routes and bodies are ``api.py``'s, the same the in-process client gets; this
file adds what a socket needs: loopback by default, an optional API key (``Authorization:
Bearer KEY``, compared in constant time; 401 otherwise), a request size limit (413, checked
on the declared length and on the bytes read), SSE streaming (a client that disconnects aborts
its request), and a clean shutdown: on SIGINT / SIGTERM uvicorn stops accepting, in-flight
requests get a grace period, then the service releases its held KV and closes the engine.
Needs the ``serve`` extra (fastapi, uvicorn).
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import logging
import threading

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from agentx.openai.api import CHAT_PATH, MODELS_PATH, APIResponse, handle
from agentx.openai.errors import error_body
from agentx.openai.service import DEFAULT_MODEL_NAME, ChatService

__all__ = ["ServerThread", "create_app", "serve_main"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
GRACEFUL_SHUTDOWN_S = 5


class _TooLarge(Exception):
    pass


def create_app(
    service: ChatService,
    *,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The ASGI app; its shutdown closes ``service`` (and the engine, if the service owns it)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.get_engine()  # load before the first request, not during it
        yield
        service.close()

    app = FastAPI(title="agentx", lifespan=lifespan, docs_url=None, redoc_url=None)

    async def answer(request: Request, method: str, path: str) -> Response:
        if api_key is not None and not _authorized(request, api_key):
            return _json(_refusal(401, "invalid or missing API key", "invalid_api_key"))
        try:
            content = await _read_limited(request, max_request_bytes)
        except _TooLarge:
            message = f"the request body exceeds {max_request_bytes} bytes"
            return _json(_refusal(413, message, "request_too_large"))
        result = await handle(service, method, path, content)
        if result.events is None:
            return _json(result)
        # the background close runs after the response, a disconnect included
        return StreamingResponse(
            result.events,
            media_type="text/event-stream",
            headers={"cache-control": "no-cache"},
            background=BackgroundTask(result.events.aclose),
        )

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request) -> Response:
        return await answer(request, "POST", CHAT_PATH)

    @app.get(MODELS_PATH)
    async def models(request: Request) -> Response:
        return await answer(request, "GET", MODELS_PATH)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app


def _authorized(request: Request, api_key: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())


async def _read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _TooLarge
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _TooLarge
        parts.append(part)
    return b"".join(parts)


def _refusal(status: int, message: str, code: str) -> APIResponse:
    error = error_body(status, message, "invalid_request_error", code)
    return APIResponse(error.status, error.body)


def _json(result: APIResponse) -> JSONResponse:
    return JSONResponse(result.body, status_code=result.status)


class ServerThread:
    """``app`` served by uvicorn on a background thread (tests, benchmarks, notebooks).

    ``with ServerThread(app, port=0) as server: server.base_url`` ("http://127.0.0.1:PORT/v1");
    leaving stops it and waits for its shutdown (which closes the app's service).
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="agentx-serve", daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server failed to start (see its log)")
            self._thread.join(0.01)
        return self

    @property
    def base_url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- the command -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentx serve", description="Serve the OpenAI Chat Completions API on agentx."
    )
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default SmolLM2-135M)")
    p.add_argument("--model-name", default=DEFAULT_MODEL_NAME, help="the name /v1/models lists")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--quantization", default="none", choices=("none", "auto", "int8", "int4"))
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-held-conversations", type=int, default=64)
    p.add_argument("--default-max-tokens", type=int, default=1024)
    return p


def serve_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from agentx.config import CacheConfig, EngineConfig
    from agentx.engine.client import Engine

    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        logger.warning("serving on %s without --api-key: anyone reaching it may use it", args.host)
    config = EngineConfig(
        model=args.model,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        cache=CacheConfig(kv_cache_bytes=int(args.kv_cache_gib * (1 << 30))),
    )
    service = ChatService(
        Engine(config),
        model_name=args.model_name,
        max_held_conversations=args.max_held_conversations,
        default_max_tokens=args.default_max_tokens,
        owns_engine=True,
    )
    app = create_app(service, api_key=args.api_key, max_request_bytes=args.max_request_bytes)
    try:
        uvicorn.run(
            app, host=args.host, port=args.port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S
        )
    finally:
        service.close()
    return 0
