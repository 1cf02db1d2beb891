"""The HTTP-shaped face of the services: bytes in, a status and JSON or SSE out.

Owns the routes both the in-process transport (``transport.py``) and ``agentx serve``
(``server.py``) answer, so the two behave alike byte for byte::

    POST /v1/chat/completions   a ChatCompletion, or with "stream": true an SSE stream of
                                ChatCompletionChunk ending with "data: [DONE]" (service.py)
    POST /v1/completions        a text_completion, streamed the same way (completions.py)
    POST /v1/responses          a Response, or typed "event:" SSE events (responses_api.py)
    GET  /v1/models             the served model names
    GET  /v1/models/{id}        one of them; 404 model_not_found otherwise

A body naming a model that is not served answers 404 ``model_not_found`` unless
``accept_any_model`` (the in-process client's default: frameworks hard-code model names).
Errors answer with the status and body of ``errors.py`` (unknown route 404, wrong method 405);
one that happens after a stream started (the engine died) is sent as a last ``data:
{"error": ...}`` event, which the ``openai`` client raises as ``APIError``. A large body is
decoded in a worker thread. It does not know sockets, auth or size limits.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from agentx.openai.completions import CompletionService
from agentx.openai.errors import error_body, to_api_error
from agentx.openai.responses_api import ResponsesService
from agentx.openai.service import ChatService

__all__ = ["APIHandler", "APIResponse", "SSEEvents"]

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
MODELS_PATH = "/v1/models"
POST_PATHS = (CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH)
SSE_DONE = b"data: [DONE]\n\n"
_DECODE_IN_THREAD_BYTES = 64 << 10


@dataclass(slots=True)
class APIResponse:
    """A JSON body, or (``events`` set) a stream of server-sent events."""

    status: int
    body: dict[str, Any] | None = None
    events: SSEEvents | None = None


class APIHandler:
    """Every route on one :class:`ChatService` (and the completions and responses services
    built on it). ``served_model_names`` default to the service's ``model_name``."""

    def __init__(
        self,
        service: ChatService,
        *,
        served_model_names: Sequence[str] | None = None,
        accept_any_model: bool = True,
        max_stored_responses: int | None = None,
    ) -> None:
        self.service = service
        self.completions = CompletionService(service)
        self.responses = (
            ResponsesService(service)
            if max_stored_responses is None
            else ResponsesService(service, max_stored_responses)
        )
        self.served_model_names = list(served_model_names or [service.model_name])
        self.accept_any_model = accept_any_model

    def list_models(self) -> dict:
        return {"object": "list", "data": [_model(name) for name in self.served_model_names]}

    async def handle(
        self, method: str, path: str, content: bytes, tenant: str | None = None
    ) -> APIResponse:
        """Answer one request; never raises for a bad request or an engine error."""
        path = path.rstrip("/")
        if path == MODELS_PATH or path.startswith(MODELS_PATH + "/"):
            if method != "GET":
                return _error(error_body(405, f"{path} takes GET", "invalid_request_error"))
            return self._models(path)
        if path not in POST_PATHS:
            return _error(
                error_body(404, f"no route {method} {path}", "invalid_request_error", "not_found")
            )
        if method != "POST":
            message = f"{path} takes POST"
            return _error(error_body(405, message, "invalid_request_error", "method_not_allowed"))
        try:
            body = await _decode(content)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(error_body(400, f"the body is not JSON: {exc}", "invalid_request_error"))
        except RecursionError:
            return _error(error_body(400, "the body is nested too deeply", "invalid_request_error"))
        refusal = self._check_model(body)
        if refusal is not None:
            return refusal
        if path == CHAT_PATH:
            return await self._run(self.service, body, tenant, _encode_chunk)
        if path == COMPLETIONS_PATH:
            return await self._run(self.completions, body, tenant, _encode_dict)
        return await self._run(self.responses, body, tenant, _encode_event, done=None)

    def _models(self, path: str) -> APIResponse:
        if path == MODELS_PATH:
            return APIResponse(200, self.list_models())
        name = path[len(MODELS_PATH) + 1 :]
        if name in self.served_model_names:
            return APIResponse(200, _model(name))
        return _error(_model_not_found(name))

    def _check_model(self, body: Any) -> APIResponse | None:
        name = body.get("model") if isinstance(body, dict) else None
        if self.accept_any_model or not name or name in self.served_model_names:
            return None
        return _error(_model_not_found(name))

    @staticmethod
    async def _run(
        service, body: Any, tenant: str | None, encode: Callable, done: bytes | None = SSE_DONE
    ) -> APIResponse:
        try:
            if isinstance(body, dict) and body.get("stream"):
                chunks = await service.open_stream(body, tenant)
                return APIResponse(200, events=SSEEvents(chunks, encode, done))
            result = await service.create(body, tenant)
        except Exception as exc:
            return _error(_logged(exc))
        if isinstance(result, dict):
            return APIResponse(200, result)
        return APIResponse(200, result.model_dump(mode="json", exclude_unset=True))


class SSEEvents:
    """A stream's chunks as server-sent events. ``aclose()`` (a client gone, at any point)
    aborts what still runs."""

    def __init__(self, chunks, encode: Callable[[Any], bytes], done: bytes | None) -> None:
        self._chunks = chunks
        self._encode = encode
        self._done = done
        self._events = self._produce()

    def __aiter__(self) -> SSEEvents:
        return self

    async def __anext__(self) -> bytes:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()
        await self._chunks.aclose()

    async def _produce(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._chunks:
                yield self._encode(chunk)
        except Exception as exc:
            yield b"data: " + json.dumps(_logged(exc).body).encode() + b"\n\n"
            return
        finally:
            await self._chunks.aclose()
        if self._done is not None:
            yield self._done


async def _decode(content: bytes) -> Any:
    if len(content) < _DECODE_IN_THREAD_BYTES:
        return json.loads(content or b"null")
    return await anyio.to_thread.run_sync(json.loads, content)


def _encode_chunk(chunk) -> bytes:
    return b"data: " + chunk.model_dump_json(exclude_unset=True).encode() + b"\n\n"


def _encode_dict(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _encode_event(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def _model(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "agentx"}


def _model_not_found(name: Any):
    message = f"The model {name!r} does not exist or is not served here."
    return error_body(404, message, "invalid_request_error", "model_not_found", "model")


def _logged(exc: Exception):
    error = to_api_error(exc)
    if error.status >= 500:
        logger.exception("request failed", exc_info=exc)
    return error


def _error(error) -> APIResponse:
    return APIResponse(error.status, error.body)
