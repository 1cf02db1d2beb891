"""The agentx engine in-process, behind :class:`EngineAdapter` (and used by the agentx worker).

Every request is greedy with EOS ignored; ``num_cached`` is the engine's own count of prompt
tokens served from its prefix cache. Sessions need no explicit end: the prefix cache keeps
what is worth keeping and evicts in LRU order.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

from agentx.bench.adapter import (
    Done,
    EngineAdapter,
    EngineInfo,
    GenerateRequest,
    Tokens,
    agentx_events,
)


@dataclass(frozen=True, slots=True)
class AgentxOptions:
    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct)
    threads: int | None = None
    dtype: str = "float32"
    quantization: str = "none"
    kv_cache_bytes: int = 2 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    decode_step_target_ms: float | None = None  # None: SchedulerConfig's default
    # further SchedulerConfig fields by name (the worker's --scheduler NAME=VALUE)
    scheduler_options: dict = field(default_factory=dict)
    offload: object | None = None  # an agentx.OffloadConfig (tiers below the device)
    speculative: bool | None = None  # drafting from context; None: SpeculativeConfig's default
    small_step_tokens: int | None = None  # None: EngineConfig's default

    def engine_config(self):
        from agentx import CacheConfig, EngineConfig, OffloadConfig, SchedulerConfig

        return EngineConfig(
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
            cache=CacheConfig(kv_cache_bytes=self.kv_cache_bytes),
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
        }

    def _speculative(self):
        from agentx import SpeculativeConfig

        if self.speculative is None:
            return SpeculativeConfig()
        return SpeculativeConfig(enabled=self.speculative)


class AgentxEngine(EngineAdapter):
    name = "agentx"

    def __init__(self, options: AgentxOptions | None = None) -> None:
        self.options = options or AgentxOptions()
        self.engine = None

    async def start(self) -> EngineInfo:
        import anyio

        from agentx import Engine, __version__

        self.engine = await anyio.to_thread.run_sync(Engine, self.options.engine_config())
        config = {**self.options.describe(), "max_model_len": self.engine.max_model_len}
        return EngineInfo("agentx", __version__, config)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Tokens | Done]:
        from agentx import SamplingParams

        sampling = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        stream = self.engine.stream(
            request.prompt, sampling, request_id=request.request_id, hints=self.hints_for(request)
        )
        async for event in agentx_events(stream):
            yield event

    def hints_for(self, request: GenerateRequest) -> tuple:
        """Hints sent with the request (none here; benchmarks of hint handling override it)."""
        return ()

    async def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    async def final_stats(self) -> dict | None:
        if self.engine is None:
            return None
        stats = self.engine.stats()
        return {**asdict(stats), "prefix_cache_hit_rate": stats.prefix_cache_hit_rate}
