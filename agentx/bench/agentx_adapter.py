"""The agentx engine in-process, behind :class:`EngineAdapter` (and used by the agentx worker).

Every request is greedy with EOS ignored; ``num_cached`` is the engine's own count of prompt
tokens served from its prefix cache. Sessions need no explicit end: the prefix cache keeps
what is worth keeping and evicts in LRU order. ``AgentxOptions.parallel`` is the engine's
``ParallelConfig`` (tp, dcp, pcp, ep, dp); with ``dp > 1`` the adapter drives a
``ReplicaRouter`` of ``dp`` engines (sticky sessions) instead of one engine.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

from agentx.bench.adapter import (
    BenchEngineError,
    Done,
    EngineAdapter,
    EngineInfo,
    GenerateRequest,
    Tokens,
    agentx_events,
)
from agentx.bench.segments import cached_encode, prompt_token_ids


@dataclass(frozen=True, slots=True)
class AgentxOptions:
    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct)
    threads: int | None = None
    dtype: str = "float32"
    # EngineConfig's default, and the worker's: ``agentx-inproc`` measures what the worker does
    # (with "none" it ran SmolLM2 in fp32 through torch's GEMMs, 2.6x slower on a trace)
    quantization: str = "auto"
    kv_cache_bytes: int = 2 << 30
    kv_cache_dtype: str = "auto"  # CacheConfig.kv_cache_dtype ("int8": the codes in place)
    block_size: int | None = None  # CacheConfig.block_size; None: its default
    huge_pages: bool = False  # CacheConfig.huge_pages
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    decode_step_target_ms: float | None = None  # None: SchedulerConfig's default
    # further SchedulerConfig fields by name (the worker's --scheduler NAME=VALUE)
    scheduler_options: dict = field(default_factory=dict)
    offload: object | None = None  # an agentx.OffloadConfig (tiers below the device)
    speculative: bool | None = None  # drafting from context; None: SpeculativeConfig's default
    small_step_tokens: int | None = None  # None: EngineConfig's default
    parallel: dict = field(default_factory=dict)  # ParallelConfig fields: tp, dcp, pcp, ep, dp

    def engine_config(self):
        from agentx import CacheConfig, EngineConfig, OffloadConfig, ParallelConfig, SchedulerConfig

        return EngineConfig(
            parallel=ParallelConfig(**self.parallel),
            speculative=self._speculative(),
            offload=self.offload or OffloadConfig(),
            model=self.model,
            dtype=self.dtype,
            quantization=self.quantization,
            num_threads=self.threads,
            **(
                {}
                if self.small_step_tokens is None
                else {"small_step_tokens": self.small_step_tokens}
            ),
            cache=CacheConfig(
                kv_cache_bytes=self.kv_cache_bytes,
                kv_cache_dtype=self.kv_cache_dtype,
                huge_pages=self.huge_pages,
                **({} if self.block_size is None else {"block_size": self.block_size}),
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                **(
                    {}
                    if self.decode_step_target_ms is None
                    else {"decode_step_target_ms": self.decode_step_target_ms}
                ),
                **self.scheduler_options,
            ),
        )

    def describe(self) -> dict:
        return {
            "model": self.model or "default (SmolLM2-135M-Instruct)",
            "threads": self.threads or os.cpu_count(),
            "dtype": self.dtype,
            "quantization": self.quantization,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_cache_dtype": self.kv_cache_dtype,
            **({} if self.block_size is None else {"block_size": self.block_size}),
            **({"huge_pages": True} if self.huge_pages else {}),
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "offload": str(self.offload) if self.offload else None,
            "speculative": self._speculative().enabled,
            **(
                {}
                if self.small_step_tokens is None
                else {"small_step_tokens": self.small_step_tokens}
            ),
            **({"scheduler": dict(self.scheduler_options)} if self.scheduler_options else {}),
            **({"parallel": dict(self.parallel)} if self.parallel else {}),
        }

    def _speculative(self):
        from agentx import SpeculativeConfig

        if self.speculative is None:
            return SpeculativeConfig()
        return SpeculativeConfig(enabled=self.speculative)


class AgentxAdapter(EngineAdapter):
    name = "agentx"

    def __init__(self, options: AgentxOptions | None = None) -> None:
        self.options = options or AgentxOptions()
        self.engine = None
        self.router = None  # with dp > 1: a ReplicaRouter, and ``engine`` is its first replica
        self._encode = None  # the engine's tokenizer, for text prompts

    async def start(self) -> EngineInfo:
        import anyio

        from agentx import Engine, __version__

        config = self.options.engine_config()
        if config.parallel.dp > 1:
            from agentx.engine.router import ReplicaRouter

            self.router = await anyio.to_thread.run_sync(ReplicaRouter, config)
            self.engine = self.router.replicas[0]
        else:
            self.engine = await anyio.to_thread.run_sync(Engine, config)
        self._encode = cached_encode(self.engine.tokenizer.encode)
        info = {**self.options.describe(), "max_model_len": self.engine.max_model_len}
        return EngineInfo("agentx", __version__, info)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Tokens | Done]:
        from agentx import AgentXError, SamplingParams

        sampling = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        prompt = prompt_token_ids(request.prompt, self._encode)
        fields = {"request_id": request.request_id, "hints": self.hints_for(request)}
        try:
            if self.router is None:
                stream, engine = self.engine.add_request(prompt, sampling, **fields), self.engine
            else:
                replica, stream = self.router.route(
                    prompt, sampling, session_id=request.session_id, **fields
                )
                engine = self.router.replicas[replica]
        except AgentXError as exc:
            raise BenchEngineError(str(exc)) from exc
        try:
            async for event in agentx_events(stream, request.return_ids):
                yield event
        finally:
            if not stream.finished:
                engine.abort(stream.request_id)

    async def end_session(self, session_id: str) -> None:
        if self.router is not None:
            self.router.end_session(session_id)

    def hints_for(self, request: GenerateRequest) -> tuple:
        """Hints sent with the request (none here; benchmarks of hint handling override it)."""
        return ()

    async def close(self) -> None:
        if self.router is not None:
            self.router.close()
        elif self.engine is not None:
            self.engine.close()
        self.engine = self.router = None

    async def final_stats(self) -> dict | None:
        if self.engine is None:
            return None
        if self.router is not None:
            return {"replicas": [_stats(e) for e in self.router.replicas]}
        return _stats(self.engine)


def _stats(engine) -> dict:
    stats = engine.stats()
    return {**asdict(stats), "prefix_cache_hit_rate": stats.prefix_cache_hit_rate}
