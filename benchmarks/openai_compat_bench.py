"""One multi-turn conversation three ways: Session, the in-process OpenAI client, agentx serve.

Each path runs the same questions on one shared engine (greedy, streamed): a ``Session`` keeps
the conversation itself; the in-process ``agentx.openai.AsyncOpenAI`` and the official
``openai`` client against ``agentx serve`` on loopback are stateless callers that re-send the
whole history every turn. Per path it prints the mean and P50 time to first token over the
turns after the first, the first turn's, the total wall time, and the cached tokens of the
last turn. Each path's system message names the path, so no path reuses another's cache.

    python benchmarks/openai_compat_bench.py [--turns 12] [--max-tokens 32]
    python benchmarks/openai_compat_bench.py --turns 2 --max-tokens 4      # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field

import openai

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams, Session
from agentx.openai import AsyncOpenAI, ChatService
from agentx.openai.server import ServerThread, create_app

QUESTIONS = [
    "Name a color and say why you like it.",
    "Name an animal that has that color.",
    "Where does it live?",
    "What does it eat?",
    "Name a fruit of the same color.",
    "Describe its taste.",
    "Name a city you would visit.",
    "What would you see there?",
    "Name a song about that city.",
    "Who sings it?",
    "Name a sport played there.",
    "Summarize our conversation.",
]


@dataclass
class PathResult:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    last_cached: int = 0
    last_prompt: int = 0


async def run_session(engine: Engine, questions: list[str], max_tokens: int) -> PathResult:
    result = PathResult("Session")
    sampling = SamplingParams(max_tokens=max_tokens)
    start = time.perf_counter()
    async with Session(engine, system="Conversation over: Session.", sampling=sampling) as s:
        for question in questions:
            t0 = time.perf_counter()
            first = None
            async with s.stream(question) as turn:
                async for event in turn:
                    if first is None and event.type == "text.delta":
                        first = time.perf_counter()
                message = await turn.get_final_message()
            result.ttft_s.append((first or time.perf_counter()) - t0)
            result.last_cached = message.usage.cached_tokens
            result.last_prompt = message.usage.prompt_tokens
    result.total_s = time.perf_counter() - start
    return result


async def run_client(
    name: str, client: openai.AsyncOpenAI, questions: list[str], max_tokens: int
) -> PathResult:
    result = PathResult(name)
    history = [{"role": "system", "content": f"Conversation over: {name}."}]
    start = time.perf_counter()
    for question in questions:
        history.append({"role": "user", "content": question})
        t0 = time.perf_counter()
        first, parts, usage = None, [], None
        stream = await client.chat.completions.create(
            model="agentx",
            messages=history,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.perf_counter()
                    parts.append(choice.delta.content)
        result.ttft_s.append((first or time.perf_counter()) - t0)
        history.append({"role": "assistant", "content": "".join(parts)})
        result.last_cached = usage.prompt_tokens_details.cached_tokens
        result.last_prompt = usage.prompt_tokens
    result.total_s = time.perf_counter() - start
    return result


def report(results: list[PathResult], args) -> None:
    print(f"turns={args.turns} max_tokens={args.max_tokens} (greedy, streamed, one engine)\n")
    print(
        "| path | TTFT turn 1 ms | TTFT later turns mean ms | P50 ms | total s "
        "| last turn cached / prompt |\n|---|---|---|---|---|---|"
    )
    for r in results:
        later = r.ttft_s[1:] or r.ttft_s
        print(
            f"| {r.name} | {r.ttft_s[0] * 1e3:.1f} | {statistics.fmean(later) * 1e3:.1f} "
            f"| {statistics.median(later) * 1e3:.1f} | {r.total_s:.2f} "
            f"| {r.last_cached} / {r.last_prompt} |"
        )


async def main_async(args) -> None:
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.turns)]
    config = EngineConfig(model=args.model, cache=CacheConfig(kv_cache_bytes=512 << 20))
    with Engine(config) as engine:
        engine.wait_ready()
        results = [await run_session(engine, questions, args.max_tokens)]
        local = AsyncOpenAI(engine)
        results.append(await run_client("in-process client", local, questions, args.max_tokens))
        await local.close()
        service = ChatService(engine)
        with ServerThread(create_app(service)) as server:
            remote = openai.AsyncOpenAI(base_url=server.base_url, api_key="-", max_retries=0)
            results.append(await run_client("agentx serve", remote, questions, args.max_tokens))
            await remote.close()
    report(results, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default SmolLM2)")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
