"""Chat messages in the OpenAI / Anthropic shape, the tool calls they carry, and turn usage.

This file owns the message records an agent author builds and reads back: ``SystemMessage``,
``UserMessage``, ``AssistantMessage`` (text plus parsed ``ToolCall``s), ``ToolMessage`` (a tool
result), the ``Message`` union discriminated on ``role``, and ``Usage``. It does not know how a
model renders tool calls into text (``tool_calls.py``) nor how a chat template is applied.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from agentx.engine.outputs import TokenLogprob
from agentx.errors import InvalidRequestError

__all__ = [
    "AssistantMessage",
    "Message",
    "MessageInput",
    "SystemMessage",
    "ToolCall",
    "ToolMessage",
    "Usage",
    "UserMessage",
    "coerce_message",
    "to_template_dict",
]

ROLES = ("system", "user", "assistant", "tool")


class ToolCall(BaseModel):
    """One call the model asked for.

    A malformed call (bad JSON, no name, arguments that are not an object) is still a call: it
    has ``error`` set, ``raw`` holds the model's text for it and ``arguments`` may be ``{}``, so
    the agent loop can answer it with an error ``ToolMessage`` instead of crashing.
    """

    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    raw: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @model_validator(mode="before")
    @classmethod
    def _from_openai_shape(cls, data: Any) -> Any:
        # OpenAI history nests the call under "function" and sends arguments as a JSON string.
        if not isinstance(data, dict) or "function" not in data:
            return data
        function = data["function"] or {}
        arguments = function.get("arguments") or {}
        flat = {"id": data.get("id"), "name": function.get("name")}
        if not isinstance(arguments, str):
            return flat | {"arguments": arguments}
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return flat | {"raw": arguments, "error": f"invalid JSON arguments: {exc}"}
        if not isinstance(decoded, dict):
            return flat | {"raw": arguments, "error": "arguments must be a JSON object"}
        return flat | {"arguments": decoded}


class Usage(BaseModel):
    """Token counts and timings of one turn (or, summed with ``+``, of a tree of turns).

    ``computed_tokens`` are prompt tokens that had to be prefilled (not served from a cache).
    ``draft_tokens`` were drafted from context and verified (``SpeculativeConfig``);
    ``accepted_draft_tokens`` of them became output without a step of their own.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    output_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    ttft_s: float | None = None
    output_tokens_per_s: float | None = None

    def __add__(self, other: Usage) -> Usage:
        if not isinstance(other, Usage):
            return NotImplemented
        # Timings do not add up across turns; the left side (the parent) keeps its own.
        return Usage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
            computed_tokens=self.computed_tokens + other.computed_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            draft_tokens=self.draft_tokens + other.draft_tokens,
            accepted_draft_tokens=self.accepted_draft_tokens + other.accepted_draft_tokens,
            ttft_s=_first_set(self.ttft_s, other.ttft_s),
            output_tokens_per_s=_first_set(self.output_tokens_per_s, other.output_tokens_per_s),
        )

    def __radd__(self, other: Any) -> Usage:
        # Lets sum(usages) start from its default 0.
        if other == 0:
            return self
        return NotImplemented


def _first_set(left: float | None, right: float | None) -> float | None:
    return left if left is not None else right


class SystemMessage(BaseModel):
    role: Literal["system"] = "system"
    content: str


class UserMessage(BaseModel):
    role: Literal["user"] = "user"
    content: str


class AssistantMessage(BaseModel):
    """A model answer: plain text (tool-call markup removed) and the calls it made.

    A turn with ``response_format`` sets ``parsed`` to the validated answer (the pydantic
    model's instance, or a dict for a JSON schema), or ``parse_error`` when the reply did not
    end as the grammar does (a stop string) or failed a check the grammar could not express.
    On a constrained turn (``tool_choice``, ``response_format``) ``finish_reason == "length"``
    means the token budget closed the reply early: it is complete and parses, but cut short.
    """

    role: Literal["assistant"] = "assistant"
    content: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    parsed: Any = None
    parse_error: str | None = None
    # with SamplingParams(logprobs=k): one record per generated token (not sent back in history)
    logprobs: list[TokenLogprob] | None = Field(default=None, exclude=True, repr=False)

    @field_validator("content", mode="before")
    @classmethod
    def _null_content(cls, value: Any) -> Any:
        # OpenAI history sends content null on a message that only calls tools.
        return "" if value is None else value

    @property
    def text(self) -> str:
        return self.content


class ToolMessage(BaseModel):
    """The result of one tool call, sent back to the model."""

    role: Literal["tool"] = "tool"
    tool_call_id: str
    content: str
    is_error: bool = False
    name: str | None = None


Message = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]
# what an agent author may pass as a message: a str (a user message), a dict, or a Message
MessageInput = str | dict[str, Any] | Message
_MESSAGE_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)
_MESSAGE_TYPES = (SystemMessage, UserMessage, AssistantMessage, ToolMessage)


def to_template_dict(message: Message) -> dict[str, str]:
    """What a chat template reads. Assistant tool calls must already be rendered into content."""
    return {"role": message.role, "content": message.content}


def coerce_message(item: MessageInput) -> Message:
    """A message from what an agent author passes: a str is a user message, a dict is validated.

    Raises ``InvalidRequestError`` naming what is wrong with a dict or an unsupported type.
    """
    if isinstance(item, _MESSAGE_TYPES):
        return item
    if isinstance(item, str):
        return UserMessage(content=item)
    if not isinstance(item, dict):
        raise InvalidRequestError(
            f"a message must be a str, a dict or a Message, not {type(item).__name__}"
        )
    if item.get("role") not in ROLES:
        raise InvalidRequestError(
            f"message role must be one of {', '.join(ROLES)}; got {item.get('role')!r}"
        )
    try:
        return _MESSAGE_ADAPTER.validate_python(item)
    except ValidationError as exc:
        raise InvalidRequestError(f"invalid {item['role']} message: {_summarize(exc)}") from exc


def _summarize(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors(include_url=False):
        # The first loc element is the union tag ("user", ...): the role is already named.
        loc = ".".join(str(p) for p in error["loc"][1:])
        parts.append(f"{loc}: {error['msg']}" if loc else error["msg"])
    return "; ".join(parts)
