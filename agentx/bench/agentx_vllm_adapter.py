"""agentx on vLLM behind :class:`EngineAdapter`: the bench's ``agentx-vllm`` engine.

Each trace session is driven the way a Session drives its engine: every turn is a request on
the vLLM backend (``agentx.engine.vllm.VLLMEngine``) that holds its KV for the session's next
turn and continues the previous turn's hold, so ``compare`` puts raw vLLM (the ``vllm`` peer)
and agentx-on-vLLM side by side on one trace. Greedy, EOS ignored; ``num_cached`` is vLLM's
``num_cached_tokens``. Runs in a venv with vllm (``python -m agentx.bench.worker --backend
vllm``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

from agentx.bench.adapter import (
    BenchEngineError,
    Done,
    EngineAdapter,
    EngineInfo,
    GenerateRequest,
    Tokens,
)
from agentx.bench.segments import prompt_token_ids


@dataclass(frozen=True, slots=True)
class AgentxVLLMOptions:
    model: str | None = None  # a Hugging Face folder; None: the embedded default, exported
    threads: int | None = None
    dtype: str = "float32"
    kv_cache_gib: int = 2
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    block_size: int = 64  # as the vllm peer's default: the same prefix-cache unit
    compile: bool = True  # torch.compile'd graphs, as the vllm peer's default (not eager)

    def config(self):
        from agentx.engine.vllm import VLLMConfig

        return VLLMConfig(
            model=self.model,
            dtype=self.dtype,
            num_threads=self.threads,
            cpu_kv_cache_gib=max(1, int(self.kv_cache_gib)),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            block_size=self.block_size,
            enforce_eager=not self.compile,
        )


class AgentxVLLMAdapter(EngineAdapter):
    name = "agentx-vllm"

    def __init__(self, options: AgentxVLLMOptions | None = None) -> None:
        self.options = options or AgentxVLLMOptions()
        self.engine = None
        self._held: dict[str, str] = {}  # session -> the handle of its last turn's KV

    async def start(self) -> EngineInfo:
        import anyio
        import vllm

        from agentx.engine.vllm import VLLMEngine

        self.engine = await anyio.to_thread.run_sync(VLLMEngine, self.options.config())
        config = {**asdict(self.options), "max_model_len": self.engine.max_model_len}
        return EngineInfo("agentx-vllm", f"vllm {vllm.__version__}", config)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Tokens | Done]:
        from agentx import AgentXError, RequestOptions, SamplingParams

        sampling = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        options = RequestOptions(hold_kv=True, held_kv=self._held.pop(request.session_id, None))
        try:
            tokenizer = getattr(self.engine, "tokenizer", None)
            prompt = prompt_token_ids(request.prompt, tokenizer and tokenizer.encode)
            stream = self.engine.add_request(
                prompt, sampling, request_id=request.request_id, options=options
            )
            output: list[int] = []
            try:
                async for out in stream:
                    if out.new_token_ids:
                        output.extend(out.new_token_ids)
                        yield Tokens(len(out.new_token_ids))
                    if out.finished:
                        self._held[request.session_id] = request.request_id
                        ids = tuple(output) if request.return_ids else None
                        yield Done(len(output), out.num_cached_tokens, ids)
            finally:
                if not stream.finished:
                    self.engine.abort(stream.request_id)
        except AgentXError as exc:
            raise BenchEngineError(str(exc)) from exc

    async def end_session(self, session_id: str) -> None:
        handle = self._held.pop(session_id, None)
        if handle is not None and self.engine is not None:
            self.engine.release_held_soon(handle)

    async def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    async def final_stats(self) -> dict | None:
        if self.engine is None:
            return None
        stats = self.engine.stats()
        return {**asdict(stats), "prefix_cache_hit_rate": stats.prefix_cache_hit_rate}
