"""Does greedy output stay the same alone, batched, chunked and after preemption, per dtype?

    python benchmarks/greedy_invariance.py --dtype bfloat16

Prints, per prompt, the first output index where batched / chunked (threshold 16) / preempted
runs diverge from the run alone ("-" when identical). fp32 is tested for this in
tests/engine/test_engine_greedy.py; this script shows what other dtypes do.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig  # noqa: E402

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:\n1.",
]
CHAT = [{"role": "user", "content": "What is 2+2? Answer in one short sentence."}]
GREEDY = SamplingParams(max_tokens=64, ignore_eos=True)


def run(dtype: str, prompts: list[list[int]], batched: bool, **config) -> list[list[int]]:
    config.setdefault("cache", CacheConfig(kv_cache_bytes=256 << 20))
    with Engine(EngineConfig(dtype=dtype, **config)) as engine:
        if batched:
            return [g.token_ids for g in engine.generate(prompts, GREEDY)]
        return [engine.generate([p], GREEDY)[0].token_ids for p in prompts]


def first_difference(a: list[int], b: list[int]) -> str:
    return next((str(i) for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    dtype = parser.parse_args().dtype
    with Engine(EngineConfig(cache=CacheConfig(num_blocks=64))) as engine:
        tok = engine.tokenizer
        prompts = [tok.encode(t) for t in TEXTS] + [tok.encode(tok.apply_chat_template(CHAT))]
    alone = run(dtype, prompts, batched=False)
    batched = run(dtype, prompts, batched=True)
    chunked = run(
        dtype, prompts, batched=True, scheduler=SchedulerConfig(long_prefill_token_threshold=16)
    )
    preempted = run(dtype, prompts, batched=True, cache=CacheConfig(num_blocks=25))
    print(f"dtype {dtype}: first diverging output index vs alone ('-' = identical)")
    print("| prompt | batched | chunked 16 | preempted |")
    print("|---|---|---|---|")
    for i, a in enumerate(alone):
        row = [first_difference(a, other[i]) for other in (batched, chunked, preempted)]
        print(f"| {i} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
