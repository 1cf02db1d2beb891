"""The Responses API's bodies: a request's ``input`` as chat messages, its tools and text
format as the chat request's, and the ``Response`` object and its output items (JSON-ready
dicts in OpenAI's shape). Pure functions; ``responses_api.py`` runs them. It does not know the
engine or HTTP.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

from agentx.errors import InvalidRequestError

__all__ = [
    "chat_response_format",
    "chat_tool_choice",
    "chat_tools",
    "copy_item",
    "input_messages",
    "message_item",
    "new_id",
    "output_items",
    "response_body",
    "response_status",
    "response_usage",
]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def copy_item(item: dict) -> dict:
    return json.loads(json.dumps(item))


def response_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def response_body(body: Mapping, response_id: str, status: str) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": body.get("model") or "agentx",
        "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"),
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": list(body.get("tools") or []),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
        "error": None,
        "usage": None,
    }


def message_item(text: str = "") -> dict:
    return {
        "type": "message",
        "id": new_id("msg"),
        "role": "assistant",
        "status": "in_progress",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def output_items(content: str, calls: list[tuple[str, str, str]]) -> list[dict]:
    items = []
    if content:
        items.append({**message_item(content), "status": "completed"})
    for call_id, name, arguments in calls:
        items.append(
            {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": call_id,
                "name": name,
                "arguments": arguments,
                "status": "completed",
            }
        )
    return items


def response_usage(chat: Mapping) -> dict[str, Any]:
    details = chat.get("prompt_tokens_details") or {}
    prompt, output = chat.get("prompt_tokens", 0), chat.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def input_messages(raw: Any) -> list[dict]:
    """``input`` as chat messages: a string is one user message; items are messages,
    ``function_call`` (joined into the assistant message before them) and
    ``function_call_output`` (a tool message)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise InvalidRequestError("input must be a string or a list of items")
    messages: list[dict] = []
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise InvalidRequestError(f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item, i)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        else:
            raise InvalidRequestError(f"input[{i}]: items of type {kind!r} are not supported")
    return messages


def _content(item: Mapping, i: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"input[{i}].content must be a string or a list of parts")
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") not in (
            "input_text",
            "output_text",
            "text",
        ):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidRequestError(f"input[{i}]: only text parts are supported, got {kind!r}")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def chat_tools(raw: Any) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise InvalidRequestError("tools must be a list")
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise InvalidRequestError(f"tools[{i}]: only function tools are supported")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        tools.append({"type": "function", "function": function})
    return tools or None


def chat_tool_choice(raw: Any) -> Any:
    if isinstance(raw, Mapping) and raw.get("type") == "function" and "name" in raw:
        return {"type": "function", "function": {"name": raw["name"]}}
    return raw


def chat_response_format(raw: Any) -> dict | None:
    if raw is None:
        return None
    fmt = raw.get("format") if isinstance(raw, Mapping) else None
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise InvalidRequestError("text.format must be an object")
    if fmt.get("type") == "json_schema":
        schema = {"name": fmt.get("name", "answer"), "schema": fmt.get("schema", {})}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}
