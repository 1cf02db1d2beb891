"""A tool result streamed into the session while the tool still runs.

Each ``write`` appends the chunk to the open tool message and prefills everything so far in the
background (a one-token request that extends the session's held KV and is held in turn), so
when the tool finishes the next turn computes only what arrived last plus the template's
closing tokens. Chunks are prefilled one after another, never concurrently.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentx.engine.sampling import SamplingParams
from agentx.engine.streams import RequestStream
from agentx.session.messages import ToolMessage

if TYPE_CHECKING:
    from agentx.session.session import Session

_PREFILL = SamplingParams(max_tokens=1)


class StreamedToolResult:
    def __init__(self, session: Session, call_id: str, is_error: bool = False) -> None:
        self._session = session
        self._call_id = call_id
        self.is_error = is_error
        self._snapshot = None
        self._chunks: list[str] = []
        self._inflight: RequestStream | None = None

    async def __aenter__(self) -> StreamedToolResult:
        session = self._session
        self._snapshot = session._begin_turn()
        try:
            self._call = session._take_call(self._call_id)
            session._context.open_message("tool")
        except BaseException:
            session._end_turn(self._snapshot, committed=False)
            raise
        return self

    async def write(self, chunk: str) -> None:
        """Append a chunk; its prefill starts now and runs while the tool keeps working."""
        if not chunk:
            return
        await self._wait_inflight()
        self._chunks.append(chunk)
        self._session._context.append_to_open(chunk)
        prompt = self._session._context.token_ids
        self._inflight = self._session._submit(prompt, _PREFILL, hold_kv=True)

    async def _wait_inflight(self) -> None:
        stream, self._inflight = self._inflight, None
        if stream is None:
            return
        try:
            async for _ in stream:
                pass
        except BaseException:
            if not stream.finished:
                self._session.engine.abort(stream.request_id)
            raise
        self._session._held_kv = stream.request_id  # held: the next piece extends it

    async def __aexit__(self, exc_type, exc, tb) -> None:
        session = self._session
        if exc_type is not None:
            if self._inflight is not None and not self._inflight.finished:
                session.engine.abort(self._inflight.request_id)
            session._end_turn(self._snapshot, committed=False)
            return
        try:
            await self._wait_inflight()
        except BaseException:
            session._end_turn(self._snapshot, committed=False)
            raise
        session._context.close_message()
        session._messages.append(
            ToolMessage(
                tool_call_id=self._call_id,
                content="".join(self._chunks),
                is_error=self.is_error,
                name=self._call.name,
            )
        )
        session._end_turn(self._snapshot, committed=True)
