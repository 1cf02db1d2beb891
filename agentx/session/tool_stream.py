"""A tool result streamed into the session while the tool still runs.

Each ``write`` appends the chunk to the open tool message and prefills everything so far in the
background (a one-token request that continues from the session's held KV and is held in turn),
so when the tool finishes the next turn computes only what arrived last plus the template's
closing tokens. Chunks are prefilled one after another, never concurrently. It is a turn of its
own (the session's turn life cycle): leaving with an error aborts the prefill and rolls back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentx.engine.sampling import SamplingParams
from agentx.engine.streams import RequestStream
from agentx.session.context import ChatContext

if TYPE_CHECKING:
    from agentx.session.session import Session

_PREFILL = SamplingParams(max_tokens=1)


class StreamedToolResult:
    def __init__(self, session: Session, call_id: str, is_error: bool = False) -> None:
        self._session = session
        self._call_id = call_id
        self.is_error = is_error
        self._context: ChatContext | None = None
        self._chunks: list[str] = []
        self._inflight: RequestStream | None = None

    async def __aenter__(self) -> StreamedToolResult:
        session = self._session
        context = session._begin_turn()
        try:
            self._call = session._take_call(self._call_id)
            context.open_message("tool")
        except BaseException:
            session._end_turn()
            raise
        self._context = context
        return self

    async def write(self, chunk: str) -> None:
        """Append a chunk; its prefill starts now and runs while the tool keeps working."""
        if not chunk:
            return
        await self._wait_inflight()
        self._chunks.append(chunk)
        self._context.append_to_open(chunk)
        self._inflight = self._session._submit(self._context.token_ids, _PREFILL)

    async def _wait_inflight(self) -> None:
        """Wait for the last chunk's prefill; its KV is held, and the next piece continues it.
        A failure propagates; leaving the ``async with`` then aborts the prefill."""
        stream, self._inflight = self._inflight, None
        if stream is None:
            return
        async for _ in stream:
            pass
        self._session._settle(stream)

    async def __aexit__(self, exc_type, exc, tb) -> None:
        session = self._session
        try:
            if exc_type is None:
                await self._wait_inflight()
                content = "".join(self._chunks)
                session._commit_tool_result(self._call, content, self.is_error)
        finally:
            session._end_turn()  # not committed (an error, a cancellation): aborted
