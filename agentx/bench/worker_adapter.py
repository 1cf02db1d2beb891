"""An engine in a subprocess that speaks :mod:`agentx.bench.protocol`, behind
:class:`EngineAdapter`.

One reader task parses the worker's stdout and routes each event to the queue of its request
id; ``generate`` writes a line and drains its queue. A worker that dies fails every live request
(and every later one) with :class:`BenchEngineError`; its stderr goes to the driver's stderr.
Text prompts are tokenized here, before they are sent, by ``encode``: the tokenizer of the
worker's own model (:func:`agentx.bench.engines.model_encode`).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Sequence

from agentx.bench import protocol
from agentx.bench.adapter import (
    BenchEngineError,
    Done,
    EngineAdapter,
    EngineInfo,
    GenerateRequest,
    Tokens,
)
from agentx.bench.segments import Encode, cached_encode, prompt_token_ids

_STREAM_LIMIT = 1 << 24  # bytes per line; prompts are long JSON lists
# workers that answer the "stats" op: agentx's own (agentx.bench.worker, either backend) and the
# fake one; the peers' workers know only the fixed protocol
_STATS_ENGINES = ("agentx", "agentx-vllm", "fake")


class WorkerAdapter(EngineAdapter):
    def __init__(
        self,
        name: str,
        command: Sequence[str],
        start_timeout: float = 900.0,
        encode: Encode | None = None,
    ) -> None:
        self.name = name
        self._encode = cached_encode(encode) if encode is not None else None
        self.command = list(command)
        self.start_timeout = start_timeout
        self._proc: asyncio.subprocess.Process | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._dead: str | None = None
        self._ready: asyncio.Future | None = None
        self._engine = ""  # the engine the worker's "ready" named
        self._stats: asyncio.Future | None = None

    async def start(self) -> EngineInfo:
        self._proc = await asyncio.create_subprocess_exec(
            *self.command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=None,  # inherit: the worker's logs show up on our stderr
            limit=_STREAM_LIMIT,
        )
        self._ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read())
        try:
            ready = await asyncio.wait_for(asyncio.shield(self._ready), self.start_timeout)
        except TimeoutError as exc:
            raise BenchEngineError(f"{self.name}: no 'ready' in {self.start_timeout:.0f}s") from exc
        self._engine = ready["engine"]
        return EngineInfo(ready["engine"], ready["version"], ready["config"])

    async def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        try:
            async for line in self._proc.stdout:
                if line.strip():
                    self._dispatch(protocol.decode(line, "ev"))
            self._dead = f"worker exited with code {await self._proc.wait()}"
        except (protocol.ProtocolError, ValueError) as exc:
            self._dead = f"protocol error: {exc}"
        self._fail_all()

    def _dispatch(self, ev: dict) -> None:
        kind = ev["ev"]
        if kind == "ready":
            if not self._ready.done():
                self._ready.set_result(ev)
            return
        if kind == "stats":
            if self._stats is not None and not self._stats.done():
                self._stats.set_result(ev["stats"])
            return
        if kind == "error" and ev["id"] is None:
            print(f"[{self.name}] worker error: {ev['message']}", file=sys.stderr)
            return
        queue = self._queues.get(ev["id"])
        if queue is not None:
            queue.put_nowait(ev)

    def _fail_all(self) -> None:
        message = f"{self.name}: {self._dead}"
        if self._stats is not None and not self._stats.done():
            self._stats.set_result(None)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(BenchEngineError(message))
        for queue in self._queues.values():
            queue.put_nowait({"ev": "error", "id": None, "message": message})

    async def _send(self, line: bytes) -> None:
        if self._dead is not None or self._proc is None or self._proc.stdin is None:
            raise BenchEngineError(f"{self.name}: {self._dead or 'not started'}")
        try:
            self._proc.stdin.write(line)
            await self._proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise BenchEngineError(f"{self.name}: worker stdin closed") from exc

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Tokens | Done]:
        rid = request.request_id
        queue = self._queues[rid] = asyncio.Queue()
        try:
            try:
                prompt = prompt_token_ids(request.prompt, self._encode)
            except ValueError as exc:
                raise BenchEngineError(f"{self.name}: {exc}") from exc
            await self._send(
                protocol.generate_op(
                    rid, request.session_id, prompt, request.max_tokens, request.return_ids
                )
            )
            while True:
                ev = await queue.get()
                if ev["ev"] == "tokens":
                    yield Tokens(int(ev["n"]))
                elif ev["ev"] == "done":
                    ids = ev.get("token_ids")
                    yield Done(
                        int(ev["num_output"]), ev["num_cached"], None if ids is None else tuple(ids)
                    )
                    return
                else:
                    raise BenchEngineError(f"{self.name}: {ev['message']}")
        finally:
            del self._queues[rid]

    async def end_session(self, session_id: str) -> None:
        if self._dead is None:
            await self._send(protocol.end_session_op(session_id))

    async def final_stats(self, timeout: float = 30.0) -> dict | None:
        """The engine's own counters (agentx's include drafting), from workers that answer the
        "stats" op (``_STATS_ENGINES``); None from the others or a dead worker."""
        if self._engine not in _STATS_ENGINES or self._dead is not None:
            return None
        self._stats = asyncio.get_running_loop().create_future()
        try:
            await self._send(protocol.stats_op())
            return await asyncio.wait_for(self._stats, timeout)
        except (TimeoutError, BenchEngineError):
            return None
        finally:
            self._stats = None

    async def close(self, timeout: float = 30.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.returncode is None:
            try:
                proc.stdin.write(protocol.shutdown_op())
                await proc.stdin.drain()
                proc.stdin.close()
                await asyncio.wait_for(proc.wait(), timeout)
            except (TimeoutError, BrokenPipeError, ConnectionResetError):
                proc.kill()
                await proc.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
