"""A deterministic fake engine for tests: simulated time per token, an exact prefix cache.

Each request waits ``prefill_s_per_token`` per uncached prompt token, then emits one token every
``decode_s_per_token`` seconds. Its cache remembers every prompt it saw by block-aligned prefix
(``block_size`` tokens), so ``num_cached`` is the longest cached block-aligned prefix. It also
logs every call (``log``), and with ``record_prompts`` every prompt's token ids (``prompts``), so
tests can check ordering and what was sent. Text prompts are tokenized by :func:`fake_encode`
(one id per four characters); output ids are a function of the prompt's length and position.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator

from agentx.bench.adapter import Done, EngineAdapter, EngineInfo, GenerateRequest, Tokens
from agentx.bench.segments import prompt_token_ids


def fake_encode(text: str) -> list[int]:
    """A deterministic stand-in tokenizer: one id per four characters."""
    return [17 + zlib.crc32(text[i : i + 4].encode()) % 49_000 for i in range(0, len(text), 4)]


class FakeAdapter(EngineAdapter):
    name = "fake"

    def __init__(
        self,
        decode_s_per_token: float = 0.0,
        prefill_s_per_token: float = 0.0,
        block_size: int = 16,
        record_prompts: bool = False,
    ) -> None:
        self.decode_s_per_token = decode_s_per_token
        self.prefill_s_per_token = prefill_s_per_token
        self.block_size = block_size
        self._cached: set[tuple[int, ...]] = set()
        self.log: list[tuple[str, str, str]] = []  # (event, request id or session, session)
        self.live = 0
        self.max_live = 0
        self.record_prompts = record_prompts
        self.prompts: dict[str, list[int]] = {}  # request id -> prompt token ids
        self.num_finished = 0

    async def start(self) -> EngineInfo:
        return EngineInfo("fake", "0", {"decode_s_per_token": self.decode_s_per_token})

    def _lookup(self, prompt: list[int]) -> int:
        bs, cached = self.block_size, 0
        while cached + bs <= len(prompt) and tuple(prompt[: cached + bs]) in self._cached:
            cached += bs
        for end in range(bs, len(prompt) + 1, bs):
            self._cached.add(tuple(prompt[:end]))
        return cached

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Tokens | Done]:
        self.log.append(("start", request.request_id, request.session_id))
        self.live += 1
        self.max_live = max(self.max_live, self.live)
        try:
            prompt = prompt_token_ids(request.prompt, fake_encode)
            if self.record_prompts:
                self.prompts[request.request_id] = prompt
            cached = self._lookup(prompt)
            await asyncio.sleep((len(prompt) - cached) * self.prefill_s_per_token)
            for _ in range(request.max_tokens):
                await asyncio.sleep(self.decode_s_per_token)
                yield Tokens(1)
            self.log.append(("done", request.request_id, request.session_id))
            self.num_finished += 1
            n = len(prompt)
            ids = tuple(17 + (n * 31 + i) % 1000 for i in range(request.max_tokens))
            yield Done(request.max_tokens, cached, ids if request.return_ids else None)
        finally:
            self.live -= 1

    async def end_session(self, session_id: str) -> None:
        self.log.append(("end_session", session_id, session_id))

    async def final_stats(self) -> dict | None:
        return {"num_finished_requests": self.num_finished}

    async def close(self) -> None:
        self._cached.clear()
