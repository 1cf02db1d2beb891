"""Session: one agent conversation on an in-process engine.

A session keeps its chat as token ids (``ChatContext``) so every turn re-sends an exact
extension of the last one, and the engine holds the last turn's KV for the next (``hold_kv`` /
``held_kv``, see engine/kv_cache/held.py), so a turn computes only its new tokens. It owns
tools, pending tool results, forks and hints; it never blocks the event loop on the engine
(engine calls that wait run in a worker thread).

    async with Session(tools=[get_weather]) as s:
        reply = await s.send("What's the weather in Paris?")
        async with s.stream("And in Rome?") as turn:
            async for event in turn: ...
        children = await s.fork(2)

A turn may be constrained (``constraints.py``): ``tool_choice="required"`` (or ``"auto"``,
``"none"``, ``{"name": "get_weather"}``) or ``response_format=Model``; the engine then samples
only what the grammar allows, so the calls parse and validate, or the answer is ``parsed``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import overload

import anyio

from agentx.engine.backend import EngineBackend
from agentx.engine.draft import DraftSource
from agentx.engine.request import RequestOptions
from agentx.engine.sampling import SamplingParams
from agentx.engine.streams import Generation, RequestStream
from agentx.errors import (
    InvalidRequestError,
    PromptTooLongError,
    SessionClosedError,
    SessionError,
    TurnInProgressError,
    UnknownToolCallError,
)
from agentx.session.constraints import ResponseFormat, ToolChoice, make_turn_constraint
from agentx.session.context import ChatContext
from agentx.session.default import get_default_engine
from agentx.session.hints import Hint, Pin, Priority, Release, make_hints
from agentx.session.messages import (
    AssistantMessage,
    Message,
    MessageInput,
    ToolCall,
    ToolMessage,
    Usage,
    coerce_message,
    to_template_dict,
)
from agentx.session.tool_calls import ToolCallParser
from agentx.session.tool_exec import execute_calls
from agentx.session.tool_formats import (
    ToolCallFormat,
    format_for_tokenizer,
    get_tool_call_format,
)
from agentx.session.tools import Tool, make_tools
from agentx.session.turn import Turn

_DEFAULT_SAMPLING = SamplingParams(max_tokens=512)
DEFAULT_TOOL_TIMEOUT_S = 300.0


@dataclass(slots=True)
class _Owed:
    """The engine and the held-KV handle a session would release on close."""

    engine: EngineBackend | None = None
    handle: str | None = None


def _release_owed(owed: _Owed) -> None:
    """A session was collected without close(): release its held KV. Runs on whatever thread
    collected it, so it must not block (``release_held_eventually`` takes no lock)."""
    engine = owed.engine
    if engine is None or owed.handle is None or engine.closed:
        return
    engine.release_held_eventually(owed.handle)
    owed.handle = None


@dataclass(slots=True)
class _OpenTurn:
    """The open turn: what an abort restores, and the request it has in flight."""

    context: ChatContext  # the context before the turn (a fork of it)
    held_kv: str | None  # the held KV the turn's first request continues from
    pending: list[dict]
    open_calls: dict[str, ToolCall]
    inflight: RequestStream | None = None
    committed: bool = False


class Session:
    def __init__(
        self,
        engine: EngineBackend | None = None,
        *,
        system: str | None = None,
        tools=None,
        sampling: SamplingParams | None = None,
        cache_salt: str | None = None,
        tool_call_format: str | None = None,
    ) -> None:
        """``tool_call_format`` names how the model writes tool calls ("smollm2", "hermes",
        "llama3_json"; ``tool_formats.py``); None: the engine's (``EngineConfig``), else the
        one detected from its chat template."""
        if tool_call_format is not None:
            get_tool_call_format(tool_call_format)  # an unknown name fails here
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a str or None, got {cache_salt!r}")
        # what this session holds in the engine; a session dropped without close() gives it
        # back when it is collected (the finalizer holds the record, never the session)
        self._owed = _Owed()
        weakref.finalize(self, _release_owed, self._owed)
        self._engine = engine
        self.cache_salt = cache_salt  # isolates this session's (and its forks') cached KV
        self.system = system
        self.tools: dict[str, Tool] = make_tools(tools)
        self.sampling = sampling or _DEFAULT_SAMPLING
        self._tool_call_format = tool_call_format
        self._parser: ToolCallParser | None = None  # made for the engine's format on first use
        self._context: ChatContext | None = None
        self._messages: list[Message] = []
        self._pending: list[dict] = []  # tool results and messages for the next turn
        self._open_calls: dict[str, ToolCall] = {}
        self._held_kv = None  # the handle of the last turn's held KV (kept in _owed)
        self._turn: _OpenTurn | None = None  # the open turn (turn.py, tool_stream.py)
        self._closed = False
        self._parent: Session | None = None
        self._children: list[Session] = []
        self._priority = 0
        self._pinned = False
        self._drop_on_close = False
        self._hints: list[Hint] = []
        # the outputs of this session's tree (it, its parent, its siblings), which its turns
        # draft from (engine/draft.py); a fork shares its parent's
        self._draft_source = DraftSource()
        self.usage = Usage()  # this session's own turns
        self.total_usage = Usage()  # own turns plus every descendant's

    # ---- lifecycle ---------------------------------------------------------------------------

    @property
    def _engine(self) -> EngineBackend | None:
        return self._owed.engine

    @_engine.setter
    def _engine(self, engine: EngineBackend | None) -> None:
        self._owed.engine = engine

    @property
    def _held_kv(self) -> str | None:
        return self._owed.handle

    @_held_kv.setter
    def _held_kv(self, handle: str | None) -> None:
        self._owed.handle = handle

    @property
    def engine(self) -> EngineBackend:
        """The engine; without one given, the process-wide default (loaded on first use)."""
        if self._engine is None:
            self._engine = get_default_engine()
        return self._engine

    async def __aenter__(self) -> Session:
        if self._engine is None:
            self._engine = await anyio.to_thread.run_sync(get_default_engine)
        self._ensure_context()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the children, release this session's KV. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for child in list(self._children):
            await child.close()
        if self._turn is not None:  # a turn still open: its request and held KV go too
            self._abort_turn()
        if self._held_kv is not None:
            self.engine.release_held_soon(self._held_kv, self._drop_on_close)
            self._held_kv = None
        if self._parent is not None and self in self._parent._children:
            self._parent._children.remove(self)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    @property
    def children(self) -> list[Session]:
        return list(self._children)

    def _ensure_context(self) -> ChatContext:
        if self._context is None:
            specs = [t.to_dict() for t in self.tools.values()] or None
            tokenizer, fmt = self.engine.tokenizer, self.tool_format
            self._context = ChatContext.with_tools(tokenizer, self.system, specs, fmt)
        return self._context

    @property
    def tool_format(self) -> ToolCallFormat:
        """How this session's model writes tool calls: the Session's ``tool_call_format``, the
        engine's, or the one its chat template shows."""
        return self._get_parser().format

    def _get_parser(self) -> ToolCallParser:
        if self._parser is None:
            fmt = format_for_tokenizer(self.engine.tokenizer, self._tool_call_format)
            self._parser = ToolCallParser(tool_format=fmt)
        return self._parser

    # ---- turns -------------------------------------------------------------------------------

    def stream(
        self,
        message: MessageInput | None = None,
        *,
        sampling: SamplingParams | None = None,
        prefill: str | None = None,
        tool_choice: ToolChoice | None = None,
        response_format: ResponseFormat | None = None,
        parallel_tool_calls: bool = True,
    ) -> Turn:
        """A streaming turn: ``async with s.stream("...") as turn: async for event in turn``.

        ``message`` (a str, a dict or a Message) joins any pending tool results. ``prefill``
        starts the assistant's reply with the given text; it is part of the reply and of the
        history. ``tool_choice`` (``"auto"``, ``"required"``, ``"none"``, ``{"name": ...}``)
        or ``response_format`` (a pydantic model class or a JSON schema) constrain this turn's
        reply with a grammar; neither combines with the other nor with ``prefill``
        (InvalidRequestError, raised here). ``parallel_tool_calls=False`` lets that grammar
        write one call at most (a model that queues edits before reading the file it edits).
        """
        sampling = sampling or self.sampling
        tools = list(self.tools.values())
        # misuse raises before the engine starts (the format may need its chat template): a
        # first build uses the format known so far, the model's replaces it once all is valid
        known = self._parser.format if self._parser is not None else None
        parallel = parallel_tool_calls
        constraint = make_turn_constraint(
            tools, tool_choice, response_format, parallel_calls=parallel, tool_format=known
        )
        if constraint is not None:
            constraint.sampling_for(sampling, prefill)
            if known is None:
                fmt = self.tool_format
                rebuilt = make_turn_constraint(
                    tools, tool_choice, response_format, parallel_calls=parallel, tool_format=fmt
                )
                assert rebuilt is not None  # the same arguments made one above
                constraint = rebuilt
            sampling = constraint.sampling_for(sampling, prefill)
        new = list(self._pending)
        if message is not None:
            new.append(to_template_dict(coerce_message(message)))
        return Turn(self, new, sampling, self._get_parser(), prefill, constraint)

    async def send(
        self,
        message: MessageInput | None = None,
        *,
        sampling: SamplingParams | None = None,
        prefill: str | None = None,
        tool_choice: ToolChoice | None = None,
        response_format: ResponseFormat | None = None,
        parallel_tool_calls: bool = True,
    ) -> AssistantMessage:
        """One turn to completion: the assistant message (text, tool calls, usage, and
        ``parsed`` with ``response_format``)."""
        async with self.stream(
            message,
            sampling=sampling,
            prefill=prefill,
            tool_choice=tool_choice,
            response_format=response_format,
            parallel_tool_calls=parallel_tool_calls,
        ) as turn:
            return await turn.get_final_message()

    def _check_usable(self) -> None:
        if self._closed:
            raise SessionClosedError("this session is closed")
        if self._turn is not None:
            raise TurnInProgressError("a turn is already open on this session")

    # ---- the turn life cycle: what turn.py and tool_stream.py call ---------------------------
    #
    #   _begin_turn() -> context     one turn at a time; snapshots what an abort restores
    #   _submit(prompt, sampling)    the turn's request: continues from the held KV, held in turn
    #   _settle(stream)              that request finished: its KV is the session's held KV now
    #   _commit_turn(...) / _commit_tool_result(...)   fold the turn into the history
    #   _end_turn()                  close the turn; one not committed is aborted (_abort_turn)

    def _begin_turn(self) -> ChatContext:
        """Open a turn; returns the context its prompt is built on (and appended to)."""
        self._check_usable()
        context = self._ensure_context()
        self._turn = _OpenTurn(
            context.fork(), self._held_kv, list(self._pending), dict(self._open_calls)
        )
        return context

    def _submit(self, prompt: list[int], sampling: SamplingParams) -> RequestStream:
        self._check_turn_open()
        options = RequestOptions(
            priority=self._priority,
            cache_salt=self.cache_salt,
            hold_kv=True,
            held_kv=self._held_kv,
            hints=tuple(self._hints),
            draft_source=self._draft_source,
        )
        stream = self.engine.add_request(prompt, sampling, options=options)
        self._held_kv = None  # the request adopts it (or it is released when the request runs)
        self._hints = []
        self._check_turn_open().inflight = stream
        return stream

    def _settle(self, stream: RequestStream) -> None:
        """The in-flight request finished; a completed one left its KV held for the next."""
        turn = self._check_turn_open()
        completed = stream.final is not None and stream.final.finish_reason in ("stop", "length")
        self._held_kv = stream.request_id if completed else None
        turn.inflight = None

    def _commit_turn(
        self,
        gen: Generation,
        message: AssistantMessage,
        sent: list[dict],
        prefill_ids: list[int],
        prefill: str,
    ) -> None:
        """The assistant's reply (``gen``, after ``prefill``) answers the ``sent`` messages."""
        turn = self._check_turn_open()
        if turn.inflight is None:
            raise SessionError("no request in flight to commit")
        self._settle(turn.inflight)
        output_ids = prefill_ids + gen.token_ids
        self._ensure_context().commit_output(output_ids, prefill + gen.text, gen.finish_reason)
        if self._held_kv is not None and self._pinned:
            self.engine.pin_held_soon(self._held_kv)
        # tool results entered the history when they were added
        self._messages.extend(coerce_message(m) for m in sent if m["role"] != "tool")
        self._messages.append(message)
        self._pending = []
        self._open_calls = {c.id: c for c in message.tool_calls}
        self._add_usage(message.usage)
        turn.committed = True

    def _commit_tool_result(self, call: ToolCall, content: str, is_error: bool) -> None:
        """A streamed tool result is complete: the open tool message (its chunks already in
        the context) is closed and enters the history."""
        turn = self._check_turn_open()
        self._ensure_context().close_message()
        self._messages.append(
            ToolMessage(tool_call_id=call.id, content=content, is_error=is_error, name=call.name)
        )
        turn.committed = True

    def _check_turn_open(self) -> _OpenTurn:
        """The open turn; SessionClosedError when close() aborted it while it ran."""
        if self._turn is None:
            raise SessionClosedError("the session was closed during the turn")
        return self._turn

    def _end_turn(self) -> None:
        """Close the open turn; one that was not committed is aborted. Idempotent."""
        if self._turn is not None and not self._turn.committed:
            self._abort_turn()
        self._turn = None

    def _abort_turn(self) -> None:
        """Abort the turn's request if it still runs and roll the session back to the turn's
        start (the held KV it would have adopted is released)."""
        turn, self._turn = self._turn, None
        if turn is None:
            return
        if turn.inflight is not None:
            # The request may have finished (its KV held under its id) before the abort
            # reaches the loop, or long before (a `break` after the last token, a validator
            # that raised): release its id too. The loop applies aborts before releases.
            rid = turn.inflight.request_id
            if not turn.inflight.finished:
                self.engine.abort(rid)
            self.engine.release_held_soon(rid)
        self._context, self._pending, self._open_calls = turn.context, turn.pending, turn.open_calls
        if turn.held_kv is not None and self._held_kv is None:
            # the aborted request may never have run to adopt or release it
            self.engine.release_held_soon(turn.held_kv)

    def _add_usage(self, usage: Usage | None) -> None:
        if usage is None:
            return
        self.usage = self.usage + usage
        node: Session | None = self
        while node is not None:
            node.total_usage = node.total_usage + usage
            node = node._parent

    # ---- tools -------------------------------------------------------------------------------

    def add_tool_result(self, call_id: str, content: str, is_error: bool = False) -> None:
        """Answer a tool call of the last assistant message; sent with the next turn.

        Checked before the call is taken, so a bad result leaves the call open for a good one:
        ``content`` must be a str (InvalidRequestError) and must leave the next prompt room in
        the model context (PromptTooLongError)."""
        self._check_usable()
        if not isinstance(call_id, str):
            raise UnknownToolCallError(f"a tool call id is a str, got {call_id!r}")
        if not isinstance(content, str):
            raise InvalidRequestError(f"tool result content must be a str, got {content!r}")
        if not isinstance(is_error, bool):
            raise InvalidRequestError(f"is_error must be a bool, got {is_error!r}")
        if call_id not in self._open_calls:
            self._take_call(call_id)  # raises UnknownToolCallError
        self._check_room([*(m["content"] for m in self._pending), content])
        call = self._take_call(call_id)
        self._pending.append({"role": "tool", "content": content})
        self._messages.append(
            ToolMessage(tool_call_id=call_id, content=content, is_error=is_error, name=call.name)
        )

    def _check_text_fits(self, num_chars: int) -> None:
        """PromptTooLongError when any text of ``num_chars`` characters added to the context
        overflows it: known without tokenizing (``Tokenizer.min_num_tokens``), so a huge
        message is refused at once."""
        engine = self.engine
        max_len = getattr(engine, "max_model_len", None)
        if max_len is None:
            return
        num = len(self._ensure_context().token_ids) + engine.tokenizer.min_num_tokens(num_chars)
        if num >= max_len:
            raise PromptTooLongError(
                f"the new messages have {num_chars} characters: the prompt would be at least "
                f"{num} tokens; the model context is {max_len}"
            )

    def _check_room(self, texts: list[str]) -> None:
        """PromptTooLongError if ``texts`` added to the context leave no room to generate (a
        lower bound of the next prompt: the template adds a few tokens more)."""
        engine = self.engine
        max_len = getattr(engine, "max_model_len", None)
        if max_len is None:
            return
        tokenizer = engine.tokenizer
        num_context = len(self._ensure_context().token_ids)
        # a bound known without tokenizing first: a 10 MB result is refused at once, not
        # after seconds of tokenizing on the caller's event loop
        num = num_context + tokenizer.min_num_tokens(sum(len(t) for t in texts))
        if num < max_len:
            num = num_context + sum(len(tokenizer.encode(t)) for t in texts)
        if num >= max_len:
            raise PromptTooLongError(
                f"the tool result would make the next prompt at least {num} tokens; the model "
                f"context is {max_len}: shorten it (the call stays open)"
            )

    def _take_call(self, call_id: str) -> ToolCall:
        call = self._open_calls.pop(call_id, None)
        if call is None:
            known = ", ".join(sorted(self._open_calls)) or "none"
            raise UnknownToolCallError(f"no open tool call {call_id!r} (open calls: {known})")
        return call

    def tool_result(self, call_id: str):
        """Stream a tool's result while it runs: each chunk is prefilled as it arrives.

        ``async with s.tool_result(call_id) as out: await out.write(chunk)``
        """
        from agentx.session.tool_stream import StreamedToolResult

        return StreamedToolResult(self, call_id)

    async def run(
        self,
        message: MessageInput | None = None,
        *,
        max_turns: int = 8,
        sampling: SamplingParams | None = None,
        prefill: str | None = None,
        tool_choice: ToolChoice | None = None,
        response_format: ResponseFormat | None = None,
        tool_timeout: float | None = DEFAULT_TOOL_TIMEOUT_S,
    ) -> AssistantMessage:
        """The plain agent loop: generate, run the Python tools the model called (concurrently),
        feed the results back; stop when a turn makes no tool call or after ``max_turns``.
        A tool still running after ``tool_timeout`` seconds is abandoned; the model reads a
        timeout error as its result.
        ``prefill``, ``tool_choice`` and ``response_format`` apply to the first turn only:
        later turns are unconstrained, so the model can answer from the tool results (a
        ``response_format`` reply makes no call, so the loop ends with it)."""
        reply = await self.send(
            message,
            sampling=sampling,
            prefill=prefill,
            tool_choice=tool_choice,
            response_format=response_format,
        )
        for _ in range(max_turns - 1):
            if not reply.tool_calls:
                break
            results = await execute_calls(self.tools, reply.tool_calls, tool_timeout)
            for call, (content, is_error) in zip(reply.tool_calls, results, strict=True):
                self.add_tool_result(call.id, content, is_error)
            reply = await self.send(sampling=sampling)
        return reply

    # ---- forks -------------------------------------------------------------------------------

    @overload
    async def fork(self, n: None = None) -> Session: ...

    @overload
    async def fork(self, n: int) -> list[Session]: ...

    async def fork(self, n: int | None = None) -> Session | list[Session]:
        """One child (``n`` None) or a list of ``n``: each continues from this exact context and
        shares its KV by reference; a child's first turn computes only its new tokens. A child
        starts with no grammar: ``tool_choice`` / ``response_format`` end with their turn."""
        self._check_usable()
        count = 1 if n is None else n
        handles: list[str] = []
        if self._held_kv is not None:
            handles = await anyio.to_thread.run_sync(self.engine.fork_held, self._held_kv, count)
        children = [self._make_child(handles[i] if handles else None) for i in range(count)]
        return children[0] if n is None else children

    def _make_child(self, handle: str | None) -> Session:
        child = Session(
            self.engine,
            system=self.system,
            tools=list(self.tools.values()),
            cache_salt=self.cache_salt,
            tool_call_format=self._tool_call_format,
        )
        child.sampling = self.sampling
        child._context = self._ensure_context().fork()
        child._messages = list(self._messages)
        child._pending = list(self._pending)
        child._open_calls = dict(self._open_calls)
        child._held_kv = handle
        child._priority = self._priority
        child._draft_source = self._draft_source
        child._parent = self
        self._children.append(child)
        return child

    async def join(
        self, children: list[Session], *, call_ids: list[str] | None = None, close: bool = True
    ) -> list[str]:
        """Fold the children's last answers back: as tool results for ``call_ids`` (one per
        child), else as one user message for the next turn. Returns the answers. SessionError
        for a session that is not this one's child (forked from it), before anything is folded
        or closed."""
        strangers = [child for child in children if child._parent is not self]
        if strangers:
            raise SessionError(
                f"join takes this session's children (its forks); {len(strangers)} of the "
                f"{len(children)} given are not"
            )
        answers = [child._last_answer() for child in children]
        if call_ids is not None:
            if len(call_ids) != len(children):
                raise UnknownToolCallError("join needs one call id per child")
            for call_id, answer in zip(call_ids, answers, strict=True):
                self.add_tool_result(call_id, answer)
        else:
            self._check_usable()
            lines = [f"[{i + 1}] {answer}" for i, answer in enumerate(answers)]
            self._pending.append(
                {"role": "user", "content": "Subagent results:\n" + "\n".join(lines)}
            )
        if close:
            for child in children:
                await child.close()
        return answers

    def _last_answer(self) -> str:
        for message in reversed(self._messages):
            if isinstance(message, AssistantMessage):
                return message.content
        return ""

    # ---- hints -------------------------------------------------------------------------------

    def hint(self, *hints: Hint, **shorthand) -> None:
        """Tell the runtime what comes next (``ToolLatency(8.0)``, ``BranchPoint(4)``,
        ``TurnsLeft(30)``, ``Priority(-1)``, ``Pin()``, ``Release()``, or keywords such as
        ``tool_latency=8.0``, ``priority=-1``, ``pin=True``, ``release=True``).
        Hints travel with the next turn's request: ``BranchPoint(n)`` before the turn whose end
        is forked, ``TurnsLeft(k)`` counts the turns after it (see hints.py)."""
        self._check_closed()
        for item in make_hints(hints, shorthand):
            if isinstance(item, Priority):
                self._priority = item.level
            elif isinstance(item, Pin):
                self._pinned = item.pinned
                if self._held_kv is not None:
                    self.engine.pin_held_soon(self._held_kv, item.pinned)
            elif isinstance(item, Release):
                self._drop_on_close = item.drop_cached
            self._hints.append(item)

    def _check_closed(self) -> None:
        if self._closed:
            raise SessionClosedError("this session is closed")
