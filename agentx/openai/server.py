"""The ASGI app of ``agentx serve`` and a thread to run it (the command is serve_command.py).

One engine and one :class:`ChatService` serve every connection (requests from all clients
batch together in the engine, and a client's re-sent history continues its held
conversation). Routes and bodies are ``api.py``'s, the same the in-process client gets; this
file adds what a socket needs:

- ``http_guard.py`` first: Host, Origin (CORS, preflight) and ``application/json`` checks;
- API keys (``Authorization: Bearer KEY``, compared in constant time; 401 otherwise); each key
  is its own tenant, whose cached prefixes no other key's requests can hit;
- a request size limit (413, checked on the declared length and on the bytes read);
- a non-streamed request whose client disconnects is aborted (the connection is polled); a
  streamed one is aborted when its stream closes;
- ``GET /health``, ``GET /metrics`` (Prometheus, ``metrics.py``);
- every error, FastAPI's own 404 / 405 / 422 included, as OpenAI's ``{"error": {...}}``;
- a clean shutdown: on SIGINT / SIGTERM uvicorn stops accepting, in-flight requests get a
  grace period, then the service releases its held KV and closes the engine.

Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import threading
from collections.abc import Sequence

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from agentx.openai.api import APIHandler, APIResponse
from agentx.openai.errors import error_body
from agentx.openai.http_guard import HTTPGuard
from agentx.openai.metrics import CONTENT_TYPE, ServerMetrics
from agentx.openai.service import ChatService

__all__ = ["ServerThread", "create_app"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
GRACEFUL_SHUTDOWN_S = 5
DISCONNECT_POLL_S = 0.1
_ROUTE_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


class _TooLarge(Exception):
    pass


def create_app(
    service: ChatService,
    *,
    api_key: str | Sequence[str] | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    served_model_names: Sequence[str] | None = None,
    accept_any_model: bool = False,
    host: str = "127.0.0.1",
    allowed_hosts: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
) -> FastAPI:
    """The ASGI app; its shutdown closes ``service`` (and the engine, if the service owns it).

    ``api_key``: one key or several (each a tenant). A body naming a model outside
    ``served_model_names`` (default: the service's name) is a 404 unless ``accept_any_model``.
    """
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    api = APIHandler(
        service, served_model_names=served_model_names, accept_any_model=accept_any_model
    )
    metrics = ServerMetrics(service)
    service.on_finished = metrics.observe

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.get_engine()  # load before the first request, not during it
        yield
        service.close()

    app = FastAPI(title="agentx", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.api = api
    app.state.metrics = metrics

    async def answer(request: Request) -> Response:
        tenant = None
        if keys:
            key = _authorized(request, keys)
            if key is None:
                return _json(_refusal(401, "invalid or missing API key", "invalid_api_key"))
            tenant = "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
        try:
            content = await _read_limited(request, max_request_bytes)
        except _TooLarge:
            message = f"the request body exceeds {max_request_bytes} bytes"
            return _json(_refusal(413, message, "request_too_large"))
        work = api.handle(request.method, request.url.path, content, tenant)
        result = await _unless_disconnected(request, work)
        if result is None:  # the client left: the request was cancelled (and aborted)
            return Response(status_code=499)
        if result.events is None:
            return _json(result)
        # the background close runs after the response, a disconnect included
        return StreamingResponse(
            result.events,
            media_type="text/event-stream",
            headers={"cache-control": "no-cache"},
            background=BackgroundTask(result.events.aclose),
        )

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.api_route("/v1/{path:path}", methods=_ROUTE_METHODS)
    async def v1(request: Request) -> Response:
        return await answer(request)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return _json(_refusal(exc.status_code, message, code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _json(_refusal(422, str(exc.errors()), "invalid_request"))

    app.add_middleware(
        HTTPGuard, host=host, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins
    )
    return app


async def _unless_disconnected(request: Request, work) -> APIResponse | None:
    """``work``'s result, or None when the client disconnected first (``work`` is cancelled:
    a non-streamed request stops generating for nobody)."""
    result = None
    async with anyio.create_task_group() as group:

        async def run() -> None:
            nonlocal result
            result = await work
            group.cancel_scope.cancel()

        async def watch() -> None:
            while not await request.is_disconnected():
                await anyio.sleep(DISCONNECT_POLL_S)
            group.cancel_scope.cancel()

        group.start_soon(run)
        group.start_soon(watch)
    return result


def _authorized(request: Request, keys: list[str]) -> str | None:
    """The key the request presents, when it is one of ``keys``."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    found = None
    for key in keys:  # every key is compared: the time does not say which one matched
        if hmac.compare_digest(token.encode(), key.encode()):
            found = key
    return found


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


def _refusal(status: int, message: str, code: str | None) -> APIResponse:
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
