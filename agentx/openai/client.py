"""``AsyncOpenAI`` / ``OpenAI``: the official clients, answered by an in-process engine.

    from agentx.openai import AsyncOpenAI

    client = AsyncOpenAI()                       # the embedded default model, in this process
    reply = await client.chat.completions.create(model="agentx", messages=[...], tools=[...])
    reply.usage.prompt_tokens_details.cached_tokens

They are subclasses of ``openai.AsyncOpenAI`` and ``openai.OpenAI`` whose HTTP client talks to a
:class:`ChatService` in this process (``transport.py``), so return values, streams and
exceptions are the ``openai`` package's own, and anything that takes an ``openai`` client
(pydantic-ai, the OpenAI Agents SDK) takes these. ``max_retries`` defaults to 0: a local engine
that failed will not succeed on a retry. Closing the client releases the held conversations;
it does not close an engine it was given (nor the process-wide default).
"""

from __future__ import annotations

from typing import Any

import httpx2
import openai

from agentx.engine.backend import EngineBackend
from agentx.openai.service import ChatService
from agentx.openai.transport import AsyncInProcessTransport, InProcessTransport

__all__ = ["AsyncOpenAI", "OpenAI"]

IN_PROCESS_URL = "http://agentx.in-process/v1"


def _client_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs.setdefault("api_key", "agentx-in-process")
    kwargs.setdefault("base_url", IN_PROCESS_URL)
    kwargs.setdefault("max_retries", 0)
    return kwargs


def _transport_args(engine: EngineBackend | None, service: ChatService | None, options) -> tuple:
    """(the service, whether the client owns it): a shared one outlives the client."""
    if service is not None:
        return service, False
    return ChatService(engine, **options), True


class AsyncOpenAI(openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` on an in-process engine (None: the process-wide default).

    ``service`` shares one :class:`ChatService` (and its held conversations) between clients;
    ``model_name``, ``max_held_conversations`` and ``default_max_tokens`` configure a new one.
    Other keywords go to ``openai.AsyncOpenAI`` (``with_options()`` copies keep the service).
    """

    def __init__(
        self,
        engine: EngineBackend | None = None,
        *,
        service: ChatService | None = None,
        model_name: str | None = None,
        max_held_conversations: int | None = None,
        default_max_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("http_client") is None:  # with_options() passes the existing one
            options = _service_options(model_name, max_held_conversations, default_max_tokens)
            transport = AsyncInProcessTransport(*_transport_args(engine, service, options))
            kwargs["http_client"] = httpx2.AsyncClient(transport=transport)
        super().__init__(**_client_kwargs(kwargs))

    @property
    def service(self) -> ChatService:
        return self._client._transport.service


class OpenAI(openai.OpenAI):
    """``openai.OpenAI`` on an in-process engine; the engine runs the requests on a private
    event loop thread while the caller's thread waits. Arguments as for :class:`AsyncOpenAI`."""

    def __init__(
        self,
        engine: EngineBackend | None = None,
        *,
        service: ChatService | None = None,
        model_name: str | None = None,
        max_held_conversations: int | None = None,
        default_max_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("http_client") is None:
            options = _service_options(model_name, max_held_conversations, default_max_tokens)
            transport = InProcessTransport(*_transport_args(engine, service, options))
            kwargs["http_client"] = httpx2.Client(transport=transport)
        super().__init__(**_client_kwargs(kwargs))

    @property
    def service(self) -> ChatService:
        return self._client._transport.service


def _service_options(model_name, max_held_conversations, default_max_tokens) -> dict[str, Any]:
    options = {
        "model_name": model_name,
        "max_held_conversations": max_held_conversations,
        "default_max_tokens": default_max_tokens,
    }
    return {key: value for key, value in options.items() if value is not None}
