"""Run a trace on several engines at several concurrencies, one fresh engine per point.

Points run in concurrency order; at each concurrency the engines take turns, and the engine that
goes first rotates (A B, then B A, ...), so slow drift of the machine does not favour one engine.
Every point starts a cold engine (no cache carried over). Ctrl-C stops the point that is
running, keeps what it measured and ends the sweep; ``on_result`` sees every finished point
(the CLI writes the results file there, so a crash loses at most the running point).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from agentx.bench.adapter import EngineAdapter
from agentx.bench.prompts import PromptSource
from agentx.bench.records import RunResult
from agentx.bench.replay import Replay, ReplayConfig
from agentx.bench.trace import Trace


@dataclass(frozen=True, slots=True)
class SweepPoint:
    engine: str
    concurrency: int


def plan(engines: Sequence[str], concurrencies: Sequence[int]) -> list[SweepPoint]:
    points = []
    for i, c in enumerate(concurrencies):
        k = i % len(engines)
        points += [SweepPoint(e, c) for e in (*engines[k:], *engines[:k])]
    return points


async def run_point(
    factory: Callable[[], EngineAdapter],
    trace: Trace,
    config: ReplayConfig,
    prompts: PromptSource,
) -> RunResult:
    """Start a fresh engine, replay the trace once, close it. Ctrl-C ends the replay early."""
    adapter = factory()
    loop = asyncio.get_running_loop()
    replay = Replay(trace, adapter, config, prompts)
    try:
        info = await adapter.start()
        _on_sigint(loop, replay.stop)
        result = await replay.run(info)
        return replace(result, engine_stats=await adapter.final_stats())
    finally:
        _on_sigint(loop, None)
        await adapter.close()


def _on_sigint(loop: asyncio.AbstractEventLoop, handler: Callable[[], None] | None) -> None:
    try:
        if handler is None:
            loop.remove_signal_handler(signal.SIGINT)
        else:
            loop.add_signal_handler(signal.SIGINT, handler)
    except (NotImplementedError, RuntimeError, ValueError):
        pass  # not the main thread, or no signals here: Ctrl-C raises KeyboardInterrupt


def run_sweep(
    trace: Trace,
    factories: dict[str, Callable[[], EngineAdapter]],
    concurrencies: Sequence[int],
    prompts: PromptSource,
    max_think: float,
    progress: bool = True,
    on_result: Callable[[RunResult], None] | None = None,
    loop: str = "open",
) -> list[RunResult]:
    results = []
    for point in plan(list(factories), concurrencies):
        if progress:
            print(f"[bench] {point.engine} at concurrency {point.concurrency}", file=sys.stderr)
        config = ReplayConfig(point.concurrency, max_think, progress, loop)
        result = asyncio.run(run_point(factories[point.engine], trace, config, prompts))
        result = _named(result, point.engine)
        results.append(result)
        if on_result is not None:
            on_result(result)
        if result.interrupted:
            break
    return results


def _named(result: RunResult, name: str) -> RunResult:
    """Label the run with the spec name (two specs may run the same engine)."""
    engine = replace(result.engine, config={**result.engine.config, "engine": result.engine.engine})
    return replace(result, engine=replace(engine, engine=name))
