"""The ``openai`` package's own response types, built from what the engine produced.

Owns turning one choice's streamed text into content and tool calls (:class:`ChoiceText`, a
pure accumulator), the finished :class:`ChoiceResult`, and building ``ChatCompletion``,
``ChatCompletionChunk`` and ``CompletionUsage`` (with ``prompt_tokens_details.cached_tokens``)
from them. It does not know the engine, held conversations or HTTP.

A stream for one choice reads, in order::

    {"role": "assistant", "content": ""}                 the first chunk
    {"content": "..."}                                   plain text as it becomes final
    {"tool_calls": [{"index": k, "id", "type", "function": {"name", "arguments": ""}}]}
                                                         a call's first delta, once its name
                                                         is written (tool_deltas.py)
    {"tool_calls": [{"index": k, "function": {"arguments": "..."}}]}
                                                         its argument text as it arrives
    {} + finish_reason                                   the last chunk of the choice
    choices [] + usage                                   after every choice (include_usage)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionTokenLogprob,
)
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import (
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
)
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkLogprobs
from openai.types.chat.chat_completion_message_function_tool_call import (
    ChatCompletionMessageFunctionToolCall,
    Function,
)
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_usage import (
    CompletionTokensDetails,
    CompletionUsage,
    PromptTokensDetails,
)

from agentx.engine.outputs import TokenLogprob
from agentx.engine.streams import Generation
from agentx.openai.tool_deltas import CallDelta
from agentx.session.messages import ToolCall
from agentx.session.tool_calls import ToolCallParser, ToolCallStreamFilter

__all__ = [
    "ChoiceResult",
    "ChoiceText",
    "CompletionHeader",
    "make_call_delta_chunk",
    "make_chunk",
    "make_completion",
    "make_usage",
    "make_usage_chunk",
]


@dataclass(frozen=True, slots=True)
class CompletionHeader:
    """What every chunk of one completion repeats."""

    id: str
    created: int
    model: str


class ChoiceText:
    """One choice's output text, split into content and tool calls as it streams.

    With ``parse_tool_calls`` the model's call markup is held back and each complete block
    becomes calls; a block that does not parse stays in the content as the model wrote it.
    Without it (a JSON answer), the text is the content.
    """

    def __init__(self, parse_tool_calls: bool, parser: ToolCallParser | None = None) -> None:
        self._filter = ToolCallStreamFilter(parser) if parse_tool_calls else None
        self.content_parts: list[str] = []
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """New content to show and the calls completed by ``text``."""
        if self._filter is None:
            self.content_parts.append(text)
            return text, []
        return self._take(self._filter.push(text), self._filter.take_calls())

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content and calls still held back when the output ended."""
        if self._filter is None:
            return "", []
        tail, _ = self._filter.finish()
        return self._take(tail, self._filter.take_calls())

    @property
    def content(self) -> str:
        return "".join(self.content_parts)

    def _take(self, shown: str, calls: list[ToolCall]) -> tuple[str, list[ToolCall]]:
        good = [call for call in calls if call.ok]
        shown += "".join(call.raw for call in calls if not call.ok)
        self.content_parts.append(shown)
        self.calls += good
        return shown, good


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    index: int
    content: str
    calls: list[ToolCall] = field(default_factory=list)
    generation: Generation | None = None

    @property
    def finish_reason(self) -> str:
        if self.calls:
            return "tool_calls"
        reason = self.generation.finish_reason if self.generation else "stop"
        return reason if reason in ("stop", "length") else "stop"


TokenText = Callable[[int], str]  # a token id's text (the tokenizer's, alone)


def make_logprobs(
    records: Sequence[TokenLogprob] | None, token_text: TokenText
) -> ChoiceLogprobs | None:
    """OpenAI's ``logprobs`` of a choice (or a chunk) for the engine's records; None: off."""
    if records is None:
        return None

    def entry(token_id: int) -> tuple[str, list[int]]:
        text = token_text(token_id)
        return text, list(text.encode("utf-8", "surrogatepass"))

    content = []
    for record in records:
        token, data = entry(record.token_id)
        top = [
            TopLogprob(token=t, bytes=b, logprob=lp)
            for t, b, lp in ((*entry(tid), lp) for tid, lp in record.top)
        ]
        content.append(
            ChatCompletionTokenLogprob(
                token=token, bytes=data, logprob=record.logprob, top_logprobs=top
            )
        )
    return ChoiceLogprobs(content=content, refusal=None)


def make_completion(
    header: CompletionHeader,
    choices: list[ChoiceResult],
    usage: CompletionUsage,
    token_text: TokenText | None = None,
) -> ChatCompletion:
    return ChatCompletion(
        id=header.id,
        object="chat.completion",
        created=header.created,
        model=header.model,
        choices=[
            Choice(
                index=c.index,
                finish_reason=c.finish_reason,
                logprobs=(
                    make_logprobs(c.generation.logprobs, token_text)
                    if c.generation is not None and token_text is not None
                    else None
                ),
                message=ChatCompletionMessage(
                    role="assistant",
                    content=c.content if c.content or not c.calls else None,
                    tool_calls=[_message_call(call) for call in c.calls] or None,
                ),
            )
            for c in choices
        ],
        usage=usage,
    )


def make_chunk(
    header: CompletionHeader,
    index: int,
    *,
    role: bool = False,
    content: str | None = None,
    calls: list[tuple[int, ToolCall]] = (),
    finish_reason: str | None = None,
    logprobs: ChoiceLogprobs | None = None,
) -> ChatCompletionChunk:
    """A chunk for choice ``index``; ``calls`` are (index among the choice's calls, call)."""
    delta = ChoiceDelta(
        role="assistant" if role else None,
        content=content,
        tool_calls=[_delta_call(k, call) for k, call in calls] or None,
    )
    choice = ChunkChoice(
        index=index,
        delta=delta,
        finish_reason=finish_reason,
        logprobs=chunk_logprobs(logprobs),
    )
    return _chunk(header, [choice])


def make_call_delta_chunk(
    header: CompletionHeader, index: int, delta: CallDelta
) -> ChatCompletionChunk:
    """A chunk carrying one streamed call delta: the header (id, name) or an argument piece."""
    call = ChoiceDeltaToolCall(
        index=delta.index,
        id=delta.id,
        type="function" if delta.id is not None else None,
        function=ChoiceDeltaToolCallFunction(name=delta.name, arguments=delta.arguments),
    )
    delta_ = ChoiceDelta(tool_calls=[call])
    choice = ChunkChoice(index=index, delta=delta_, finish_reason=None, logprobs=None)
    return _chunk(header, [choice])


def chunk_logprobs(logprobs: ChoiceLogprobs | None) -> ChunkLogprobs | None:
    """A choice's logprobs in a chunk's type."""
    if logprobs is None:
        return None
    return ChunkLogprobs(content=logprobs.content, refusal=None)


def make_usage_chunk(header: CompletionHeader, usage: CompletionUsage) -> ChatCompletionChunk:
    return _chunk(header, [], usage)


def make_usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=0),
    )


def _chunk(
    header: CompletionHeader, choices: list[ChunkChoice], usage: CompletionUsage | None = None
) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        id=header.id,
        object="chat.completion.chunk",
        created=header.created,
        model=header.model,
        choices=choices,
        usage=usage,
    )


def _arguments(call: ToolCall) -> str:
    return json.dumps(call.arguments, ensure_ascii=False)


def _message_call(call: ToolCall) -> ChatCompletionMessageFunctionToolCall:
    return ChatCompletionMessageFunctionToolCall(
        id=call.id, type="function", function=Function(name=call.name, arguments=_arguments(call))
    )


def _delta_call(index: int, call: ToolCall) -> ChoiceDeltaToolCall:
    return ChoiceDeltaToolCall(
        index=index,
        id=call.id,
        type="function",
        function=ChoiceDeltaToolCallFunction(name=call.name, arguments=_arguments(call)),
    )
