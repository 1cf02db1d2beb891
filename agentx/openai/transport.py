"""httpx2 transports that answer the ``openai`` client in this process, without a socket.

The official client builds an HTTP request and parses the response into its own types, raises
its own exceptions and reads SSE streams; these transports hand the request to ``api.handle``
instead of the network, so every feature of the client (``.parse()``, ``with_raw_response``,
retries, frameworks that take an ``openai.AsyncOpenAI``) works unchanged. The cost is one
JSON encoding of the request and of each response chunk, microseconds against a model step.

``AsyncInProcessTransport`` runs on the caller's event loop. ``InProcessTransport`` (the sync
client) runs the service on a private event loop thread and blocks the caller on it. Closing a
transport closes its service unless it was given one to share. It does not know the engine.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator, Iterator

import httpx2

from agentx.openai.api import APIHandler, APIResponse, SSEEvents
from agentx.openai.service import ChatService

__all__ = ["AsyncInProcessTransport", "InProcessTransport"]

_SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache"}


def _response(answer: APIResponse, request: httpx2.Request, stream=None) -> httpx2.Response:
    if answer.events is None:
        return httpx2.Response(answer.status, json=answer.body, request=request)
    return httpx2.Response(answer.status, headers=_SSE_HEADERS, stream=stream, request=request)


class _AsyncEvents(httpx2.AsyncByteStream):
    def __init__(self, events: SSEEvents) -> None:
        self._events = events

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for data in self._events:
            yield data

    async def aclose(self) -> None:
        await self._events.aclose()


class AsyncInProcessTransport(httpx2.AsyncBaseTransport):
    def __init__(self, service: ChatService, owns_service: bool = True) -> None:
        self.service = service
        self.owns_service = owns_service
        self.api = APIHandler(service)

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        content = await request.aread()
        answer = await self.api.handle(request.method, request.url.path, content)
        events = _AsyncEvents(answer.events) if answer.events is not None else None
        return _response(answer, request, events)

    async def aclose(self) -> None:
        if self.owns_service:
            self.service.close()


class _LoopThread:
    """An event loop on a daemon thread; ``run`` blocks the calling thread on a coroutine."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="agentx-openai-sync", daemon=True
        )
        self._thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self.loop.close()


class _SyncEvents(httpx2.SyncByteStream):
    def __init__(self, events: SSEEvents, loop: _LoopThread) -> None:
        self._events, self._loop = events, loop
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        while True:
            try:
                yield self._loop.run(self._events.__anext__())
            except StopAsyncIteration:
                return

    def close(self) -> None:
        """Idempotent; after the transport closed (and ended this stream) a no-op."""
        if self._closed or self._loop.loop.is_closed():
            return
        self._closed = True
        self._loop.run(self._events.aclose())


class InProcessTransport(httpx2.BaseTransport):
    def __init__(self, service: ChatService, owns_service: bool = True) -> None:
        self.service = service
        self.owns_service = owns_service
        self.api = APIHandler(service)
        self._loop = _LoopThread()
        self._open: weakref.WeakSet[_SyncEvents] = weakref.WeakSet()  # streams not closed
        self._closed = False

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        content = request.read()
        answer = self._loop.run(self.api.handle(request.method, request.url.path, content))
        events = _SyncEvents(answer.events, self._loop) if answer.events is not None else None
        if events is not None:
            self._open.add(events)
        return _response(answer, request, events)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for events in list(self._open):  # a stream still open ends its call (its KV)
                events.close()
            if self.owns_service:
                self.service.close()
            self._loop.stop()
