"""One streaming turn: submit the prompt, stream typed events, fold the output into history.

A turn is an async context manager and an async iterator of events::

    async with session.stream("...") as turn:
        async for event in turn:          # TextDelta, ToolCallEvent, ..., TurnDone
            ...
        message = await turn.get_final_message()

Leaving early, an exception or a cancellation aborts the engine request (its blocks are freed)
and rolls the session back to where it was before the turn. It owns nothing between turns.

A turn may carry a ``TurnConstraint`` (``constraints.py``): its grammar is already in the
sampling params; the turn only decides whether the reply is read for tool calls and validates a
JSON answer into ``AssistantMessage.parsed``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio

from agentx.engine.streams import RequestStream
from agentx.session.constraints import TurnConstraint
from agentx.session.events import TextDelta, ToolCallEvent, TurnDone, TurnEvent
from agentx.session.messages import AssistantMessage, Usage
from agentx.session.tool_calls import ToolCallParser, ToolCallStreamFilter

if TYPE_CHECKING:
    from agentx.session.session import Session

# new text of more characters than this is rendered and tokenized in a worker thread (a 5 MB
# message takes seconds): the caller's event loop keeps running meanwhile
_OFF_LOOP_CHARS = 64 << 10


class Turn:
    def __init__(
        self,
        session: Session,
        new_messages: list[dict],
        sampling,
        parser: ToolCallParser,
        prefill: str | None = None,
        constraint: TurnConstraint | None = None,
    ) -> None:
        self._session = session
        self._parser = parser
        self._new_messages = new_messages
        self._sampling = sampling
        self._prefill = prefill or ""
        self._constraint = constraint
        self._prefill_ids: list[int] = []
        self._stream: RequestStream | None = None
        self._events: AsyncIterator[TurnEvent] | None = None
        self._done: TurnDone | None = None
        self._t_submit = 0.0

    @property
    def request_id(self) -> str | None:
        return self._stream.request_id if self._stream else None

    async def __aenter__(self) -> Turn:
        session = self._session
        context = session._begin_turn()
        try:
            num_chars = sum(len(m.get("content") or "") for m in self._new_messages)
            session._check_text_fits(num_chars)
            if num_chars > _OFF_LOOP_CHARS:
                prompt = await anyio.to_thread.run_sync(context.prompt_for, self._new_messages)
            else:
                prompt = context.prompt_for(self._new_messages)
            if self._prefill:  # the assistant's reply starts with this text, as if generated
                self._prefill_ids = session.engine.tokenizer.encode(self._prefill)
                prompt += self._prefill_ids
            self._t_submit = time.perf_counter()
            self._stream = session._submit(prompt, self._sampling)
        except BaseException:
            session._end_turn()
            raise
        self._events = self._produce()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self._session._end_turn()  # a turn that did not reach TurnDone is aborted

    def __aiter__(self) -> Turn:
        return self

    async def __anext__(self) -> TurnEvent:
        if self._events is None:
            raise RuntimeError("iterate a turn inside `async with session.stream(...)`")
        return await self._events.__anext__()

    async def get_final_message(self) -> AssistantMessage:
        """Drain the remaining events; the assistant message as it entered the history."""
        async for _ in self:
            pass
        assert self._done is not None
        return self._done.message

    async def _produce(self) -> AsyncIterator[TurnEvent]:
        stream = self._stream
        if self._constraint is None or self._constraint.parse_tool_calls:
            text_filter = ToolCallStreamFilter(self._parser)
        else:
            text_filter = _PlainText()
        plain: list[str] = []
        t_first = None
        if shown := text_filter.push(self._prefill):
            plain.append(shown)
            yield TextDelta(text=shown)
        async for out in stream:
            if t_first is None:
                t_first = time.perf_counter()
            if shown := text_filter.push(out.new_text):
                plain.append(shown)
                yield TextDelta(text=shown)
            for call in text_filter.take_calls():
                yield ToolCallEvent(call=call)
        tail, calls = text_filter.finish()
        if tail:
            plain.append(tail)
            yield TextDelta(text=tail)
        for call in text_filter.take_calls():  # an unterminated block, reported at the end
            yield ToolCallEvent(call=call)
        self._done = self._finish(stream, "".join(plain), calls, t_first)
        yield self._done

    def _finish(
        self, stream: RequestStream, plain: str, calls: list, t_first: float | None
    ) -> TurnDone:
        gen = stream.to_generation()
        t_end = time.perf_counter()
        decode_s = t_end - t_first if t_first is not None else 0.0
        usage = Usage(
            prompt_tokens=gen.usage.prompt_tokens,
            cached_tokens=gen.usage.cached_tokens,
            computed_tokens=gen.usage.computed_prompt_tokens,
            output_tokens=gen.usage.output_tokens,
            draft_tokens=gen.usage.draft_tokens,
            accepted_draft_tokens=gen.usage.accepted_draft_tokens,
            ttft_s=(t_first - self._t_submit) if t_first is not None else None,
            output_tokens_per_s=(gen.usage.output_tokens - 1) / decode_s if decode_s > 0 else None,
        )
        parsed, parse_error = self._validate(plain, gen.finish_reason, gen.stop_reason)
        message = AssistantMessage(
            content=plain,
            tool_calls=calls,
            finish_reason=gen.finish_reason,
            usage=usage,
            parsed=parsed,
            parse_error=parse_error,
            logprobs=gen.logprobs,
        )
        self._session._commit_turn(
            gen, message, self._new_messages, self._prefill_ids, self._prefill
        )
        return TurnDone(message=message, usage=usage)

    def _validate(
        self, text: str, finish_reason: str | None, stop_reason: object
    ) -> tuple[object, str | None]:
        """``(parsed, parse_error)`` of a JSON answer; ``(None, None)`` without one. An answer
        the budget closed early (stop reason ``grammar_budget``) is complete: it is parsed."""
        validate = self._constraint.validate if self._constraint is not None else None
        if validate is None:
            return None, None
        if finish_reason != "stop" and stop_reason != "grammar_budget":
            return None, f"the answer is incomplete (finish_reason {finish_reason!r})"
        try:
            return validate(text), None
        except ValueError as exc:  # json and pydantic errors both are
            return None, f"the answer does not validate: {exc}"


class _PlainText:
    """A ``ToolCallStreamFilter`` that finds no calls: a JSON answer is shown as it is."""

    def push(self, delta: str) -> str:
        return delta

    def take_calls(self) -> list:
        return []

    def finish(self) -> tuple[str, list]:
        return "", []
