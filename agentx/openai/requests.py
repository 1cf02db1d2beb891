"""A Chat Completions request body, read into one typed record the service runs.

Owns :class:`ChatRequest` and :func:`parse_chat_request`: which body fields are understood, how
messages become chat-template dicts (and the keys a re-sent history is matched on), tools,
``tool_choice``, ``response_format`` and sampling. Every refusal is an
:class:`InvalidRequestError` naming the field, raised before anything reaches the engine. It
does not know the engine, the HTTP layer or the ``openai`` package.

A field whose meaning agentx cannot honour (penalties, ``logit_bias``, audio) is refused rather
than silently dropped; ``parallel_tool_calls=false`` allows at most one call per reply (the
grammar's), ``prompt_cache_key`` (else ``user``) names the request's tenant, whose cached
prefixes no other tenant shares; fields that only label a request (``metadata``, ``store``,
``service_tier``) are accepted and have no effect. Unknown fields are ignored, as frameworks
send provider-specific extras.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from agentx.engine.sampling import MAX_LOGPROBS, SamplingParams
from agentx.errors import InvalidRequestError
from agentx.session.messages import ToolCall
from agentx.session.tool_calls import render_raw_call, render_tool_calls
from agentx.session.tool_formats import ToolCallFormat
from agentx.session.tools import Tool

__all__ = [
    "ChatRequest",
    "MessageKey",
    "assistant_key",
    "parse_bool",
    "parse_chat_request",
    "parse_int",
    "parse_max_tokens",
    "parse_sampling",
    "parse_tenant",
]

# What a message is matched on when a caller re-sends its history: what the template renders
# (role, text, calls by name and arguments), not ids the template never shows.
MessageKey = tuple[str, str, tuple[tuple[str, str], ...]]

_OPENAI_DEFAULT_TEMPERATURE = 1.0
_MAX_STOP_STRINGS = 4
_MAX_CHOICES = 16
_REFUSED = {
    "logit_bias": "logit_bias is not supported",
    "presence_penalty": "presence_penalty is not supported",
    "frequency_penalty": "frequency_penalty is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "functions": "the deprecated 'functions' field is not supported; send 'tools'",
    "function_call": "the deprecated 'function_call' field is not supported; send 'tool_choice'",
}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """One chat completion request, validated.

    ``system`` is the leading system (or developer) message's text; ``messages`` are the rest as
    chat-template dicts, ``keys`` their match keys (same length).
    """

    model: str | None
    system: str | None
    messages: tuple[dict[str, str], ...]
    keys: tuple[MessageKey, ...]
    tools: tuple[Tool, ...]
    tool_choice: str | dict[str, Any] | None
    response_format: dict[str, Any] | None
    sampling: SamplingParams
    max_tokens: int | None  # None: the service's default, capped by the context left
    n: int
    stream: bool
    include_usage: bool
    parallel_tool_calls: bool = True
    tenant: str | None = None  # prompt_cache_key, else user: who may share cached prefixes

    @property
    def setup_key(self) -> tuple[str | None, str]:
        """What the context's system message is built from: a held context continues only a
        request with the same one."""
        specs = [tool.to_dict() for tool in self.tools]
        return self.system, json.dumps(specs, sort_keys=True)


def parse_chat_request(body: Any, tool_format: ToolCallFormat | None = None) -> ChatRequest:
    """Validate a request body (the JSON object a client posts); assistant tool calls are
    rendered in ``tool_format`` (the model's; SmolLM2's by default)."""
    if not isinstance(body, Mapping):
        raise InvalidRequestError("the request body must be a JSON object")
    for name, reason in _REFUSED.items():
        if _given(body.get(name)):
            raise InvalidRequestError(f"{name}: {reason}")
    system, messages, keys = _parse_messages(body.get("messages"), tool_format)
    n = _int(body, "n", 1)
    if not 1 <= n <= _MAX_CHOICES:
        raise InvalidRequestError(f"n must be between 1 and {_MAX_CHOICES}, got {n}")
    max_tokens = _max_tokens(body)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, Mapping):
        raise InvalidRequestError("stream_options must be an object")
    model = body.get("model")
    if isinstance(model, str) and not _encodable(model):
        raise InvalidRequestError("model must be valid Unicode text (it holds a lone surrogate)")
    return ChatRequest(
        model=model if isinstance(model, str) and model else None,
        system=system,
        messages=tuple(messages),
        keys=tuple(keys),
        tools=_parse_tools(body.get("tools")),
        tool_choice=_tool_choice(body.get("tool_choice")),
        response_format=_response_format(body.get("response_format")),
        sampling=replace(_sampling(body), logprobs=_logprobs(body)),
        max_tokens=max_tokens,
        n=n,
        stream=bool(body.get("stream")),
        include_usage=bool(stream_options.get("include_usage")),
        parallel_tool_calls=_bool(body, "parallel_tool_calls", True),
        tenant=_tenant(body),
    )


def assistant_key(content: str | None, calls: list[ToolCall]) -> MessageKey:
    """The key of an assistant reply, as :func:`parse_chat_request` computes it when the
    caller sends that reply back."""
    arguments = [(call.name, _canonical_json(call.arguments)) for call in calls]
    return "assistant", (content or "").strip(), tuple(arguments)


# ---- messages --------------------------------------------------------------------------------


def _parse_messages(
    raw: Any, tool_format: ToolCallFormat | None = None
) -> tuple[str | None, list[dict[str, str]], list[MessageKey]]:
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError("messages must be a non-empty list")
    system = None
    if isinstance(raw[0], Mapping) and _ROLES.get(raw[0].get("role")) == "system":
        system, raw = _text(raw[0].get("content"), "messages[0].content"), raw[1:]
    messages, keys = [], []
    for i, message in enumerate(raw, start=0 if system is None else 1):
        template, key = _parse_message(message, f"messages[{i}]", tool_format)
        messages.append(template)
        keys.append(key)
    return system, messages, keys


def _parse_message(
    message: Any, where: str, tool_format: ToolCallFormat | None
) -> tuple[dict[str, str], MessageKey]:
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"{where} must be an object")
    role = message.get("role")
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise InvalidRequestError(f"{where}.tool_call_id must be a string")
        text = _text(message.get("content"), f"{where}.content")
        return {"role": "tool", "content": text}, ("tool", text.strip(), ())
    if role == "assistant":
        return _parse_assistant(message, where, tool_format)
    if role not in _ROLES:
        raise InvalidRequestError(
            f"{where}.role must be system, developer, user, assistant or tool; got {role!r}"
        )
    text = _text(message.get("content"), f"{where}.content")
    return {"role": _ROLES[role], "content": text}, (_ROLES[role], text.strip(), ())


def _parse_assistant(
    message: Mapping, where: str, tool_format: ToolCallFormat | None
) -> tuple[dict[str, str], MessageKey]:
    content = message.get("content")
    text = "" if content is None else _text(content, f"{where}.content")
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise InvalidRequestError(f"{where}.tool_calls must be a list")
    calls = [
        _parse_call(call, f"{where}.tool_calls[{i}]", tool_format)
        for i, call in enumerate(raw_calls)
    ]
    # the model's own markup for the calls, as it would have written them
    rendered = text + render_tool_calls(calls, tool_format)
    return {"role": "assistant", "content": rendered}, assistant_key(text, calls)


def _parse_call(raw: Any, where: str, tool_format: ToolCallFormat | None) -> ToolCall:
    if not isinstance(raw, Mapping) or raw.get("type", "function") != "function":
        raise InvalidRequestError(f"{where} must be a function tool call")
    function = raw.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{where}.function.name must be a string")
    arguments = function.get("arguments") or "{}"
    try:
        decoded = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        decoded = None
    call_id, name = str(raw.get("id")), function["name"]
    if not isinstance(decoded, dict):  # rendered with the arguments text as it is
        markup = render_raw_call(name, str(arguments), tool_format)
        return ToolCall(id=call_id, name=name, raw=markup, error="arguments are not an object")
    return ToolCall(id=call_id, name=name, arguments=decoded)


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise InvalidRequestError(
                    f"{where}[{i}]: only text content parts are supported, got {kind!r}"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidRequestError(f"{where} must be a string or a list of text parts")


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


# ---- tools and constraints -------------------------------------------------------------------


def _parse_tools(raw: Any) -> tuple[Tool, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise InvalidRequestError("tools must be a list")
    tools = []
    for i, spec in enumerate(raw):
        if not isinstance(spec, Mapping) or spec.get("type") != "function":
            raise InvalidRequestError(f"tools[{i}]: only function tools are supported")
        tools.append(Tool.from_dict(dict(spec)))
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"tools: duplicate tool names in {names}")
    return tuple(tools)


def _tool_choice(raw: Any) -> str | dict[str, Any] | None:
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, Mapping):
        return dict(raw)
    raise InvalidRequestError(f"tool_choice must be a string or an object, got {raw!r}")


def _response_format(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or raw.get("type") not in (
        "text",
        "json_object",
        "json_schema",
    ):
        raise InvalidRequestError(
            "response_format.type must be 'text', 'json_object' or 'json_schema'"
        )
    if raw["type"] == "json_schema" and not isinstance(raw.get("json_schema"), Mapping):
        raise InvalidRequestError("response_format.json_schema must be an object")
    return None if raw["type"] == "text" else dict(raw)


# ---- sampling --------------------------------------------------------------------------------


def _sampling(body: Mapping) -> SamplingParams:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > _MAX_STOP_STRINGS):
        raise InvalidRequestError(f"stop must be a string or a list of up to {_MAX_STOP_STRINGS}")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise InvalidRequestError(f"seed must be an integer, got {seed!r}")
    return SamplingParams(
        temperature=_number(body, "temperature", _OPENAI_DEFAULT_TEMPERATURE),
        top_p=_number(body, "top_p", 1.0),
        top_k=_int(body, "top_k", 0),  # not OpenAI's; accepted as vLLM does
        seed=seed,
        max_tokens=1,  # the service sets the real budget once the prompt is known
        stop=tuple(stop or ()),
    )


def _logprobs(body: Mapping) -> int | None:
    """``logprobs: true`` (with ``top_logprobs``, 0 to 20) as the engine's top-k; None: off."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidRequestError(f"logprobs must be a boolean, got {wanted!r}")
    top = _int(body, "top_logprobs", 0)
    if not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {top}")
    if top and not wanted:
        raise InvalidRequestError("top_logprobs needs logprobs set to true")
    return top if wanted else None


def _max_tokens(body: Mapping) -> int | None:
    value = body.get("max_completion_tokens")
    name = "max_completion_tokens"
    if value is None:
        value, name = body.get("max_tokens"), "max_tokens"
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
    return value


def _number(body: Mapping, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    return float(value)


def _int(body: Mapping, name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    return value


def _bool(body: Mapping, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a boolean, got {value!r}")
    return value


def _tenant(body: Mapping) -> str | None:
    """``prompt_cache_key`` (OpenAI's cache routing key), else ``user``; None when neither."""
    for name in ("prompt_cache_key", "user"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError(f"{name} must be a string, got {value!r}")
        if value:
            return f"{name}:{value}"
    return None


def _given(value: Any) -> bool:
    """A refused field counts only when it asks for something (false, 0, null are defaults)."""
    return value not in (None, False, 0, 0.0, {}, [])


def _encodable(text: str) -> bool:
    """``text`` encodes to UTF-8: a JSON ``"\\ud800"`` decodes to a lone surrogate, which
    cannot (the reply that echoes it would fail after the request ran)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


# ---- shared with the other routes (completions.py, responses_api.py) -------------------------


def parse_sampling(body: Mapping) -> SamplingParams:
    """``temperature``, ``top_p``, ``top_k``, ``seed`` and ``stop`` of any route's body."""
    return _sampling(body)


def parse_max_tokens(body: Mapping) -> int | None:
    return _max_tokens(body)


def parse_int(body: Mapping, name: str, default: int) -> int:
    return _int(body, name, default)


def parse_bool(body: Mapping, name: str, default: bool) -> bool:
    return _bool(body, name, default)


def parse_tenant(body: Mapping) -> str | None:
    return _tenant(body)
