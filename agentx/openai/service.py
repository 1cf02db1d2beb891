"""The Chat Completions API on an in-process engine: one request in, ``openai`` types out.

:class:`ChatService` is what the in-process client's transport and ``agentx serve`` both call.
A call runs like a Session turn: the messages extend a held conversation when they can
(``conversations.py``), so the prompt is the previous prompt + output + the new messages' ids
only, and the engine adopts the previous reply's held KV; otherwise they are rendered afresh
and the prefix cache serves what it can. ``tools`` become the model's own function-calling
prompt and, with ``tool_choice`` (``"auto"`` when tools are given) or ``response_format``, a
grammar the engine enforces, so calls parse and JSON answers validate (session/constraints.py).
``n`` choices start from forks of the same held KV and share the prompt's cached blocks.

A request's tenant (an API key's, given by the server, and/or ``prompt_cache_key`` / ``user``)
salts its prefix cache and its held conversations: tenants never share cached blocks, so
``cached_tokens`` cannot tell a client whether another one sent the same system prompt.

It owns one engine (the process-wide default unless given) and the held conversations; it
does not know HTTP. Work that may take long (loading the default model, parsing, rendering and
tokenizing a request, forking held KV) runs in a worker thread; nothing here blocks the event
loop. A rendered prompt is refused before tokenizing when its text alone could not fit the
context (a 10 MB tool result is refused at once, not after seconds of tokenizing).
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import anyio
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from agentx.engine.backend import EngineBackend
from agentx.engine.models.tokenizer import Tokenizer
from agentx.engine.request import RequestOptions
from agentx.engine.sampling import MAX_SEED, SamplingParams
from agentx.engine.streams import RequestStream
from agentx.errors import PromptTooLongError
from agentx.openai.conversations import ConversationCache, HeldConversation
from agentx.openai.requests import ChatRequest, assistant_key, parse_chat_request
from agentx.openai.responses import (
    ChoiceResult,
    ChoiceText,
    CompletionHeader,
    chunk_logprobs,
    make_call_delta_chunk,
    make_chunk,
    make_completion,
    make_logprobs,
    make_usage,
    make_usage_chunk,
)
from agentx.openai.timing import RequestClock, TimingSink
from agentx.openai.tool_deltas import CallDelta, ToolCallDeltas
from agentx.session.constraints import (
    TurnConstraint,
    calls_or_answer_constraint,
    make_turn_constraint,
)
from agentx.session.context import ChatContext
from agentx.session.default import get_default_engine
from agentx.session.tool_calls import ToolCallParser
from agentx.session.tool_formats import ToolCallFormat, format_for_tokenizer

__all__ = ["ChatService", "ChunkStream", "choice_sampling"]

T = TypeVar("T")

DEFAULT_MODEL_NAME = "agentx"


@dataclass(slots=True)
class _Call:
    """One call in flight: its prompt, the context its replies extend, one stream per choice."""

    request: ChatRequest
    header: CompletionHeader
    context: ChatContext  # generating: each choice forks it to commit its reply
    prompt: list[int]
    streams: list[RequestStream]
    handles: list[str]  # held KV given to the streams (released if a stream never adopts it)
    parse_tool_calls: bool
    setup: tuple  # the held-conversation setup: the request's, salted by its tenant
    clock: RequestClock | None  # None once the call ended


class ChatService:
    """Chat completions on ``engine`` (None: the process-wide default, loaded on first use).

    ``max_held_conversations`` bounds the replies whose context and held KV are kept for a
    caller that sends them back; ``default_max_tokens`` caps a reply when the request sets no
    ``max_tokens`` (further capped by the context left). ``chat_template`` (Jinja source)
    replaces the model's own template. ``on_finished`` receives every finished request's
    :class:`RequestTiming`. ``close()`` releases the held KV and, with ``owns_engine``, closes
    the engine.
    """

    def __init__(
        self,
        engine: EngineBackend | None = None,
        *,
        model_name: str = DEFAULT_MODEL_NAME,
        max_held_conversations: int = 32,
        default_max_tokens: int = 1024,
        owns_engine: bool = False,
        chat_template: str | None = None,
        on_finished: TimingSink | None = None,
    ) -> None:
        self._engine = engine
        self._tokenizer: Tokenizer | None = None
        self.chat_template = chat_template
        self.on_finished = on_finished
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.owns_engine = owns_engine
        self._parser = ToolCallParser()
        self._conversations = ConversationCache(max_held_conversations, self._release)
        self._live: dict[int, _Call] = {}  # calls started and not ended, by id()
        self._closed = False

    # ---- lifecycle ---------------------------------------------------------------------------

    async def get_engine(self) -> EngineBackend:
        if self._engine is None:
            self._engine = await anyio.to_thread.run_sync(get_default_engine)
        return self._engine

    @property
    def engine(self) -> EngineBackend | None:
        """The engine once loaded (None before the first ``get_engine``)."""
        return self._engine

    def get_tokenizer(self, engine: EngineBackend) -> Tokenizer:
        """The engine's tokenizer, with ``chat_template`` when one was given; the tool-call
        parser follows its format from here on."""
        if self._tokenizer is None:
            tokenizer = engine.tokenizer
            if self.chat_template is not None:
                tokenizer = copy.copy(tokenizer)
                tokenizer.chat_template = self.chat_template
                tokenizer.get_compiled_chat_template()  # a template that does not parse fails now
            fmt = format_for_tokenizer(tokenizer)
            self._parser = ToolCallParser(self._parser.id_factory, tool_format=fmt)
            tokenizer.min_num_tokens(0)  # finds the longest piece once, here
            self._tokenizer = tokenizer
        return self._tokenizer

    def check_text_fits(self, engine: EngineBackend, num_chars: int) -> None:
        """Refuse text that needs more tokens than the context holds, before tokenizing it
        (``Tokenizer.min_num_tokens``)."""
        min_tokens = self.get_tokenizer(engine).min_num_tokens(num_chars)
        if min_tokens > engine.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {num_chars} characters, at least {min_tokens} tokens: more "
                f"than the model's context of {engine.max_model_len} tokens"
            )

    def finish_timing(self, route: str, clock: RequestClock, num_prompt_tokens: int) -> None:
        if self.on_finished is not None:
            self.on_finished(clock.finish(route, num_prompt_tokens))

    @property
    def conversations(self) -> ConversationCache:
        return self._conversations

    def close(self) -> None:
        """Release every held conversation; close the engine if this service owns it.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        for call in list(self._live.values()):  # a stream still open: its KV is nobody's
            self._end(call)
        self._conversations.clear()
        if self.owns_engine and self._engine is not None:
            self._engine.close()

    def _release(self, handle: str) -> None:
        if self._engine is not None and not self._engine.closed:
            self._engine.release_held_soon(handle)

    def list_models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {"id": self.model_name, "object": "model", "created": 0, "owned_by": "agentx"}
            ],
        }

    # ---- the API -----------------------------------------------------------------------------

    async def create(self, body: object, tenant: str | None = None) -> ChatCompletion:
        """A whole completion (``stream`` in ``body`` is ignored). ``tenant``: who sent it
        (the server's API-key tenant), combined with the body's ``prompt_cache_key``."""
        call = await self._start(body, tenant)
        try:
            results = []
            for index, stream in enumerate(call.streams):
                text = ChoiceText(call.parse_tool_calls, self._parser)
                async for out in stream:
                    call.clock.tick(len(out.new_token_ids))
                    text.push(out.new_text)
                text.finish()
                results.append(self._finish_choice(call, index, text))
        finally:
            self._end(call)
        return make_completion(
            call.header, results, self._usage(call, results), self._engine.tokenizer.token_to_text
        )

    async def open_stream(self, body: object, tenant: str | None = None) -> ChunkStream:
        """Validate and submit the request (raising before any chunk is produced), then
        return its chunks. Closing the stream early aborts what still runs."""
        call = await self._start(body, tenant)
        return ChunkStream(self._chunks(call), lambda: self._end(call))

    async def _chunks(self, call: _Call) -> AsyncIterator[ChatCompletionChunk]:
        header = call.header
        try:
            results = []
            # choices stream one after the other; the later ones keep running meanwhile
            for index, stream in enumerate(call.streams):
                yield make_chunk(header, index, role=True, content="")
                text = ChoiceText(call.parse_tool_calls, self._parser)
                scan = ToolCallDeltas() if call.parse_tool_calls else None
                async for out in stream:
                    call.clock.tick(len(out.new_token_ids))
                    shown, calls = text.push(out.new_text)
                    chunks = _deltas(header, index, text, scan, out.new_text, shown, calls)
                    if call.request.sampling.logprobs is not None and out.logprobs:
                        logprobs = make_logprobs(out.logprobs, self._engine.tokenizer.token_to_text)
                        if chunks:  # the tokens' logprobs ride on the first chunk they made
                            chunks[0].choices[0].logprobs = chunk_logprobs(logprobs)
                        else:
                            chunks = [make_chunk(header, index, logprobs=logprobs)]
                    for chunk in chunks:
                        yield chunk
                for chunk in _deltas(header, index, text, scan, "", *text.finish()):
                    yield chunk
                result = self._finish_choice(call, index, text)
                results.append(result)
                yield make_chunk(header, index, finish_reason=result.finish_reason)
            if call.request.include_usage:
                yield make_usage_chunk(header, self._usage(call, results))
        finally:
            self._end(call)

    # ---- one call ----------------------------------------------------------------------------

    async def _start(self, body: object, tenant: str | None) -> _Call:
        """Parse, render, tokenize and submit in a worker thread (seconds for a huge request:
        the event loop keeps serving meanwhile). A cancel that arrives meanwhile ends the
        call as soon as it exists."""
        engine = await self.get_engine()
        return await prepare_off_loop(self._prepare_call, self._end, engine, body, tenant)

    def _prepare_call(self, engine: EngineBackend, body: object, tenant: str | None) -> _Call:
        clock = RequestClock()
        tokenizer = self.get_tokenizer(engine)
        request = parse_chat_request(body, self._parser.format)
        salt = cache_salt(tenant, request.tenant)
        setup = (*request.setup_key, salt)
        held = self._conversations.take(setup, request.keys)
        handles = [held.handle] if held is not None and held.handle is not None else []
        try:
            if held is not None:
                context, new = held.context, request.messages[len(held.keys) :]
            else:
                specs = [tool.to_dict() for tool in request.tools] or None
                fmt = self._parser.format
                context = ChatContext.with_tools(tokenizer, request.system, specs, fmt)
                new = request.messages
                self.check_text_fits(engine, len(request.system or ""))
            self.check_text_fits(engine, _num_chars(new))
            prompt = context.prompt_for(list(new))
            sampling, parse_tool_calls = self._sampling(engine, request, len(prompt))
            if handles and request.n > 1:
                handles += engine.fork_held(handles[0], request.n - 1)
        except BaseException:
            for handle in handles:
                self._release(handle)
            raise
        header = CompletionHeader(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=request.model or self.model_name,
        )
        call = _Call(request, header, context, prompt, [], handles, parse_tool_calls, setup, clock)
        self._live[id(call)] = call
        try:
            for index in range(request.n):
                options = RequestOptions(
                    hold_kv=True,
                    held_kv=handles[index] if index < len(handles) else None,
                    cache_salt=salt,
                )
                seeded = choice_sampling(sampling, index)
                call.streams.append(engine.add_request(prompt, seeded, options=options))
        except BaseException:
            self._end(call)
            raise
        return call

    def _sampling(
        self, engine: EngineBackend, request: ChatRequest, num_prompt_tokens: int
    ) -> tuple[SamplingParams, bool]:
        """The request's sampling with its real budget and grammar; whether the reply is read
        for tool calls."""
        max_tokens = request.max_tokens
        if max_tokens is None:
            context_left = engine.max_model_len - num_prompt_tokens
            max_tokens = max(1, min(self.default_max_tokens, context_left))
        sampling = replace(request.sampling, max_tokens=max_tokens)
        # compiles the grammar: off the event loop
        constraint = _constraint(request, self._parser.format)
        if constraint is None:
            return sampling, bool(request.tools)
        return constraint.sampling_for(sampling, None), constraint.parse_tool_calls

    def _finish_choice(self, call: _Call, index: int, text: ChoiceText) -> ChoiceResult:
        """Fold a finished choice into a held conversation a later call can continue."""
        stream = call.streams[index]
        gen = stream.to_generation()
        result = ChoiceResult(index, text.content, list(text.calls), gen)
        if not self._closed:
            context = call.context.fork()
            context.commit_output(gen.token_ids, gen.text, gen.finish_reason)
            held = gen.request_id if gen.finish_reason in ("stop", "length") else None
            keys = (*call.request.keys, assistant_key(result.content, result.calls))
            self._conversations.put(HeldConversation(call.setup, keys, context, held))
        return result

    def _end(self, call: _Call) -> None:
        """Abort what still runs; release held KV a stream never got to adopt. Once per call
        (the stream's end and the service's close may both come)."""
        if self._live.pop(id(call), None) is None:
            return
        if call.clock is not None:
            clock, call.clock = call.clock, None
            self.finish_timing("chat", clock, len(call.prompt))
        engine = self._engine
        for stream in call.streams:
            if not stream.finished:
                engine.abort(stream.request_id)
                # it may have finished (its KV held under its id) before the abort reaches
                # the loop, which applies aborts before releases
                self._release(stream.request_id)
            elif stream.final is not None and stream.final.finish_reason not in ("stop", "length"):
                self._release(stream.request_id)  # failed: no conversation continues from it
        for index, handle in enumerate(call.handles):
            stream = call.streams[index] if index < len(call.streams) else None
            if stream is None or not stream.finished or stream.final is None:
                self._release(handle)  # a no-op when the request did adopt it

    @staticmethod
    def _usage(call: _Call, results: list[ChoiceResult]):
        completion_tokens = sum(r.generation.usage.output_tokens for r in results)
        cached = results[0].generation.usage.cached_tokens if results else 0
        return make_usage(len(call.prompt), cached, completion_tokens)


class ChunkStream:
    """The chunks of one streamed call. ``aclose()`` ends the call whenever it is called,
    before the first chunk too (a generator never started would skip its ``finally``)."""

    def __init__(self, chunks: AsyncIterator[ChatCompletionChunk], end) -> None:
        self._chunks = chunks
        self._end = end

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> ChatCompletionChunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()
        self._end()


def _constraint(request: ChatRequest, fmt: ToolCallFormat) -> TurnConstraint | None:
    """The grammar of a request. With tools, ``tool_choice`` defaults to ``"auto"`` (OpenAI's
    default: text or calls, calls that parse); with a ``response_format`` too, ``"auto"`` is
    calls or the JSON answer, ``"none"`` the answer only, a forced call the call only."""
    tools, choice, answer = list(request.tools), request.tool_choice, request.response_format
    parallel = request.parallel_tool_calls
    if not tools or answer is None:
        choice = "auto" if tools and choice is None else choice
        return make_turn_constraint(tools, choice, answer, parallel_calls=parallel, tool_format=fmt)
    if choice in (None, "auto"):
        return calls_or_answer_constraint(tools, answer, parallel_calls=parallel, tool_format=fmt)
    if choice == "none":
        return make_turn_constraint([], None, answer)
    return make_turn_constraint(tools, choice, None, parallel_calls=parallel, tool_format=fmt)


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling: a given seed is offset so choices differ, reproducibly."""
    if index == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=(sampling.seed + index) % (MAX_SEED + 1))  # stays in range


async def prepare_off_loop(prepare: Callable[..., T], end: Callable[[T], object], *args) -> T:
    """``prepare(*args)`` in a worker thread (seconds for a huge request: the event loop keeps
    serving meanwhile); a cancel that arrived meanwhile ends what it made (``end``)."""
    with anyio.CancelScope(shield=True):
        made = await anyio.to_thread.run_sync(prepare, *args)
    try:
        await anyio.lowlevel.checkpoint()
    except BaseException:
        end(made)
        raise
    return made


def cache_salt(*tenants: str | None) -> str | None:
    """The prefix-cache salt of a request's tenants (None: the shared, unsalted cache)."""
    named = [t for t in tenants if t]
    return "\x1f".join(named) if named else None


def _num_chars(messages: Sequence[dict]) -> int:
    return sum(len(str(m.get("content") or "")) for m in messages)


def _deltas(
    header, index, text: ChoiceText, scan: ToolCallDeltas | None, raw: str, shown: str, calls
) -> list[ChatCompletionChunk]:
    """Chunks for one push: the content it showed, then the argument deltas of the calls
    the raw text advanced; a call the scan could not follow goes out whole once parsed."""
    chunks = []
    if shown:
        chunks.append(make_chunk(header, index, content=shown))
    for delta in scan.push(raw) if scan is not None and raw else ():
        chunks.append(make_call_delta_chunk(header, index, delta))
    first = len(text.calls) - len(calls)
    for k, call in enumerate(calls, start=first):
        if scan is not None and scan.is_started(k) and not scan.is_streamed(k):
            rest = CallDelta(k, None, None, json.dumps(call.arguments, ensure_ascii=False))
            chunks.append(make_call_delta_chunk(header, index, rest))  # its header went out
        elif scan is None or not scan.is_streamed(k):
            chunks.append(make_chunk(header, index, calls=[(k, call)]))
    return chunks
