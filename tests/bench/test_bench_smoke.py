"""Smoke: a tiny synthesized trace replayed on the real agentx engine, in-process and through the
agentx worker. Sizes are tiny so that this stays well under a minute on 2 CPU cores."""

import asyncio
import sys

import pytest

from agentx.bench.adapter import Done, GenerateRequest, Tokens
from agentx.bench.agentx_adapter import AgentxAdapter, AgentxOptions
from agentx.bench.metrics import run_metrics
from agentx.bench.replay import Replay, ReplayConfig
from agentx.bench.synth import SynthConfig, synthesize
from agentx.bench.trace_stats import trace_stats
from agentx.bench.worker_adapter import WorkerAdapter

pytestmark = pytest.mark.slow


def test_replay_on_agentx_in_process():
    config = SynthConfig(num_sessions=2, seed=1, scale=0.01, max_context_tokens=1024)
    trace = synthesize(config)
    stats = trace_stats(trace)
    assert (stats.num_requests, stats.num_output_tokens) == (15, 102)
    engine = AgentxAdapter(AgentxOptions(threads=2, kv_cache_bytes=128 << 20))

    async def go():
        info = await engine.start()
        try:
            replay = Replay(trace, engine, ReplayConfig(concurrency=2, max_think=0, progress=False))
            return await replay.run(info), await engine.final_stats()
        finally:
            await engine.close()

    result, stats_after = asyncio.run(go())
    assert result.engine.engine == "agentx" and not result.interrupted
    assert stats_after["num_cached_tokens"] == stats.theoretical_hit_tokens
    expected = {r.num_output_tokens for _, r in trace.iter_requests()}
    assert all(r.ok for r in result.records) and len(result.records) == 15
    assert {r.num_output_tokens for r in result.records} == expected
    assert sum(r.num_output_tokens for r in result.records) == 102
    # the engine reuses exactly what the trace says was seen before (nothing evicted here)
    for r in result.records:
        assert r.num_cached_tokens == r.theoretical_hit_tokens, r.request_id
    m = run_metrics(result)
    assert m.achieved_hit_rate == m.theoretical_hit_rate == stats.theoretical_hit_rate
    assert m.num_recomputed_tokens == 0 and m.tpgs > 0 and m.ttft_p50 > 0


def test_closed_loop_text_replay_on_agentx_in_process():
    """Text prompts tokenized by the engine's own tokenizer; each turn carries its output ids."""
    from agentx.bench.prompts import TextPromptBuilder

    trace = synthesize(SynthConfig(num_sessions=2, seed=1, scale=0.01, max_context_tokens=1024))
    engine = AgentxAdapter(AgentxOptions(threads=2, kv_cache_bytes=128 << 20))

    async def go():
        info = await engine.start()
        try:
            config = ReplayConfig(concurrency=2, max_think=0, progress=False, loop="closed")
            replay = Replay(trace, engine, config, TextPromptBuilder(trace.block_size))
            return await replay.run(info)
        finally:
            await engine.close()

    result = asyncio.run(go())
    assert all(r.ok for r in result.records) and len(result.records) == 15
    assert sum(r.num_output_tokens for r in result.records) == 102
    m = run_metrics(result)
    # a turn that extends the last one finds that prompt and its output in the cache
    assert m.achieved_hit_rate > 0.5


def test_agentx_worker_speaks_the_protocol():
    command = [
        sys.executable, "-m", "agentx.bench.worker", "--kv-cache-gib", "0.125",
        "--model", "default", "--threads", "2",
    ]  # fmt: skip

    async def go():
        engine = WorkerAdapter("agentx", command)
        info = await engine.start()
        try:
            assert info.engine == "agentx" and info.config["max_model_len"] == 8192
            prompt = list(range(1000, 1040))
            first = [e async for e in engine.generate(GenerateRequest("a", "s", prompt, 3))]
            second = [e async for e in engine.generate(GenerateRequest("b", "s", prompt, 2))]
            await engine.end_session("s")
        finally:
            await engine.close()
        return first, second

    first, second = asyncio.run(go())
    assert sum(e.n for e in first if isinstance(e, Tokens)) == 3
    assert first[-1] == Done(3, 0)
    # the same prompt: every token but the last (two whole 16-token blocks, then 7 copied)
    assert second[-1] == Done(2, 39)
