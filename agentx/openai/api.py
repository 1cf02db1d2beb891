"""The HTTP-shaped face of :class:`ChatService`: bytes in, a status and JSON or SSE out.

Owns the routes both the in-process transport (``transport.py``) and ``agentx serve``
(``server.py``) answer, so the two behave alike byte for byte::

    POST /v1/chat/completions   JSON body; a ChatCompletion, or with "stream": true an SSE
                                stream of ChatCompletionChunk ending with "data: [DONE]"
    GET  /v1/models             the one model served

Errors answer with the status and body of ``errors.py``; one that happens after a stream
started (the engine died) is sent as a last ``data: {"error": ...}`` event, which the
``openai`` client raises as ``APIError``. It does not know sockets, auth or size limits.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from agentx.openai.errors import error_body, to_api_error
from agentx.openai.service import ChatService, ChunkStream

__all__ = ["APIResponse", "SSEEvents", "handle"]

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
SSE_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class APIResponse:
    """A JSON body, or (``events`` set) a stream of server-sent events."""

    status: int
    body: dict[str, Any] | None = None
    events: SSEEvents | None = None


async def handle(service: ChatService, method: str, path: str, content: bytes) -> APIResponse:
    """Answer one request; never raises for a bad request or an engine error."""
    path = path.rstrip("/")
    if path == MODELS_PATH and method == "GET":
        return APIResponse(200, service.list_models())
    if path != CHAT_PATH:
        return _error(error_body(404, f"no route {method} {path}", "invalid_request_error"))
    if method != "POST":
        return _error(error_body(405, f"{path} takes POST", "invalid_request_error"))
    try:
        body = json.loads(content or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return _error(error_body(400, f"the body is not JSON: {exc}", "invalid_request_error"))
    except RecursionError:
        return _error(error_body(400, "the body is nested too deeply", "invalid_request_error"))
    return await chat_completions(service, body)


async def chat_completions(service: ChatService, body: Any) -> APIResponse:
    try:
        if isinstance(body, dict) and body.get("stream"):
            chunks = await service.open_stream(body)
            return APIResponse(200, events=SSEEvents(chunks))
        completion = await service.create(body)
    except Exception as exc:
        return _error(_logged(exc))
    return APIResponse(200, completion.model_dump(mode="json", exclude_unset=True))


class SSEEvents:
    """A stream's chunks as server-sent events. ``aclose()`` (a client gone, at any point)
    aborts what still runs."""

    def __init__(self, chunks: ChunkStream) -> None:
        self._chunks = chunks
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
                yield b"data: " + chunk.model_dump_json(exclude_unset=True).encode() + b"\n\n"
        except Exception as exc:
            yield b"data: " + json.dumps(_logged(exc).body).encode() + b"\n\n"
            return
        finally:
            await self._chunks.aclose()
        yield SSE_DONE


def _logged(exc: Exception):
    error = to_api_error(exc)
    if error.status >= 500:
        logger.exception("chat completion failed", exc_info=exc)
    return error


def _error(error) -> APIResponse:
    return APIResponse(error.status, error.body)
