"""The Responses API, ``POST /v1/responses``, answered by the chat service.

A Responses request is translated into a Chat Completions body (``instructions`` -> the system
message, ``input`` items -> messages, flat function tools -> chat tools, ``text.format`` ->
``response_format``, ``max_output_tokens`` -> ``max_tokens``) and run by :class:`ChatService`;
its reply becomes ``output`` items (a ``message`` with ``output_text``, one ``function_call``
per call). ``previous_response_id`` is served from held KV: every stored response keeps the
chat messages it ends (a bounded LRU, ``max_stored``), a request that names it is those
messages plus its new input, so the chat service's held conversation continues and only the
new input is computed. As OpenAI does, ``instructions`` do not carry over.

A stream is OpenAI's typed events (``event: <type>`` and a ``data`` object with a
``sequence_number``)::

    response.created, response.in_progress
    response.output_item.added  (message)   response.content_part.added
    response.output_text.delta ...          response.output_text.done
    response.content_part.done              response.output_item.done
    response.output_item.added (function_call)
    response.function_call_arguments.delta ...   .done       response.output_item.done
    response.completed  (the whole response, usage included)

Bodies are JSON-ready dicts. It does not know HTTP.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from typing import Any

from agentx.errors import InvalidRequestError
from agentx.openai.responses_items import (
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    copy_item,
    input_messages,
    message_item,
    new_id,
    output_items,
    response_body,
    response_status,
    response_usage,
)
from agentx.openai.service import ChatService

__all__ = ["ResponsesService"]

DEFAULT_MAX_STORED = 256


class ResponsesService:
    """``/v1/responses`` on ``chat``; remembers the last ``max_stored`` responses."""

    def __init__(self, chat: ChatService, max_stored: int = DEFAULT_MAX_STORED) -> None:
        self.chat = chat
        self.max_stored = max_stored
        self._stored: OrderedDict[str, tuple[str | None, list[dict]]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._stored)

    async def create(self, body: object, tenant: str | None = None) -> dict[str, Any]:
        chat_body, messages = self._chat_body(body, tenant)
        completion = await self.chat.create(chat_body, tenant)
        choice = completion.choices[0]
        message = choice.message
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
        response = response_body(body, new_id("resp"), response_status(choice.finish_reason))
        response["output"] = output_items(message.content or "", calls)
        response["usage"] = response_usage(completion.usage.model_dump())
        self.store(response, tenant, messages, message.content, calls, body)
        return response

    async def open_stream(self, body: object, tenant: str | None = None) -> AsyncIterator[dict]:
        """Validate and submit (raising before any event), then the events."""
        chat_body, messages = self._chat_body(body, tenant)
        chat_body = {**chat_body, "stream": True, "stream_options": {"include_usage": True}}
        chunks = await self.chat.open_stream(chat_body, tenant)
        return _EventStream(self, body, tenant, messages, chunks)

    # ---- translation -------------------------------------------------------------------------

    def _chat_body(self, body: object, tenant: str | None) -> tuple[dict, list[dict]]:
        """The chat body, and the messages a stored response will have to re-send."""
        if not isinstance(body, Mapping):
            raise InvalidRequestError("the request body must be a JSON object")
        messages = self._previous(body.get("previous_response_id"), tenant)
        messages += input_messages(body.get("input"))
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise InvalidRequestError("instructions must be a string")
        system = [{"role": "system", "content": instructions}] if instructions else []
        chat = {
            "model": body.get("model"),
            "messages": system + messages,
            "tools": chat_tools(body.get("tools")),
            "tool_choice": chat_tool_choice(body.get("tool_choice")),
            "response_format": chat_response_format(body.get("text")),
            "max_tokens": body.get("max_output_tokens"),
        }
        for name in ("temperature", "top_p", "parallel_tool_calls", "prompt_cache_key", "user"):
            chat[name] = body.get(name)
        if body.get("top_logprobs"):
            raise InvalidRequestError("top_logprobs: logprobs are not supported")
        return {k: v for k, v in chat.items() if v is not None}, messages

    def _previous(self, response_id: Any, tenant: str | None) -> list[dict]:
        if response_id is None:
            return []
        with self._lock:
            stored = self._stored.get(response_id) if isinstance(response_id, str) else None
            if stored is not None:
                self._stored.move_to_end(response_id)
        if stored is None or stored[0] != tenant:
            raise InvalidRequestError(f"previous_response_id: no stored response {response_id!r}")
        return list(stored[1])

    def store(self, response, tenant, messages, content, calls, body) -> None:
        """Remember a finished response's messages for ``previous_response_id``."""
        if body.get("store") is False:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if calls:
            reply["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in calls
            ]
        with self._lock:
            self._stored[response["id"]] = (tenant, [*messages, reply])
            while len(self._stored) > self.max_stored:
                self._stored.popitem(last=False)


class _EventStream:
    """One response's events, built from the chat service's chunks."""

    def __init__(self, service, body, tenant, messages, chunks) -> None:
        self._service, self._body, self._tenant = service, body, tenant
        self._messages, self._chunks = messages, chunks
        self._events = self._produce()
        self._seq = 0

    def __aiter__(self) -> _EventStream:
        return self

    async def __anext__(self) -> dict:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()
        await self._chunks.aclose()

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    async def _produce(self) -> AsyncIterator[dict]:
        response = response_body(self._body, new_id("resp"), "in_progress")
        yield self._event("response.created", response=dict(response))
        yield self._event("response.in_progress", response=dict(response))
        items: list[dict] = []
        text, calls, chat_usage, finish = None, {}, None, "stop"
        try:
            async for chunk in self._chunks:
                if chunk.usage is not None:
                    chat_usage = chunk.usage.model_dump()
                for choice in chunk.choices[:1] if chunk.choices else ():
                    finish = choice.finish_reason or finish
                    delta = choice.delta
                    if delta.content:
                        if text is None:
                            text = message_item()
                            for event in self._open_message(items, text):
                                yield event
                        text["content"][0]["text"] += delta.content
                        yield self._event(
                            "response.output_text.delta",
                            item_id=text["id"],
                            output_index=items.index(text),
                            content_index=0,
                            delta=delta.content,
                        )
                    for call in delta.tool_calls or ():
                        for event in self._call_delta(items, calls, text, call):
                            yield event
                        text = None  # a call's header closed the message before it
        finally:
            await self._chunks.aclose()
        for event in self._close_all(items):
            yield event
        response.update(
            status=response_status(finish), output=items, usage=response_usage(chat_usage or {})
        )
        response["completed_at"] = int(time.time())
        done_calls = [(c["call_id"], c["name"], c["arguments"]) for c in calls.values()]
        content = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
        self._service.store(response, self._tenant, self._messages, content, done_calls, self._body)
        yield self._event("response.completed", response=response)

    def _open_message(self, items: list[dict], item: dict) -> list[dict]:
        items.append(item)
        index = len(items) - 1
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._event("response.output_item.added", output_index=index, item=copy_item(item)),
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def _call_delta(self, items, calls, text, call) -> list[dict]:
        events = []
        if call.id is not None:  # a new call: its header
            if text is not None:
                events += self._done_events(items, text)
            item = {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": call.id,
                "name": call.function.name,
                "arguments": "",
                "status": "in_progress",
            }
            items.append(item)
            calls[call.index] = item
            events.append(
                self._event(
                    "response.output_item.added", output_index=len(items) - 1, item=copy_item(item)
                )
            )
        item = calls[call.index]
        fragment = call.function.arguments or ""
        if fragment:
            item["arguments"] += fragment
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=items.index(item),
                    delta=fragment,
                )
            )
        return events

    def _close_all(self, items: list[dict]) -> list[dict]:
        events = []
        for item in items:
            if item["status"] == "in_progress":
                events += self._done_events(items, item)
        return events

    def _done_events(self, items: list[dict], item: dict) -> list[dict]:
        if item["status"] != "in_progress":
            return []
        item["status"] = "completed"
        index = items.index(item)
        if item["type"] == "message":
            part = item["content"][0]
            events = [
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                ),
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=copy_item(part),
                ),
            ]
        else:
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        events.append(
            self._event("response.output_item.done", output_index=index, item=copy_item(item))
        )
        return events
