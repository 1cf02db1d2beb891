"""What logprobs cost a step: the same batch decoded with logprobs off, top-0 and top-20.

Usage: python benchmarks/logprobs_cost.py [--batch 8] [--tokens 64] [--repeats 3]
Prints the median wall time per decoded token of the batch for each setting and the ratio to
off; run it on an idle machine (the numbers are per step, not per request).
"""

from __future__ import annotations

import argparse
import statistics
import time

from agentx import Engine, EngineConfig, SamplingParams, SpeculativeConfig


def run(engine: Engine, prompts: list[str], sampling: SamplingParams) -> float:
    start = time.perf_counter()
    gens = engine.generate(prompts, sampling)
    elapsed = time.perf_counter() - start
    return elapsed / max(len(g.token_ids) for g in gens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prompts = [f"Write a short story about the number {i}." for i in range(args.batch)]
    settings = {"off": None, "top-0": 0, "top-20": 20}
    with Engine(EngineConfig(speculative=SpeculativeConfig(enabled=False))) as engine:
        engine.wait_ready()
        times: dict[str, list[float]] = {name: [] for name in settings}
        for _ in range(args.repeats):  # interleaved: drift hits every setting alike
            for name, k in settings.items():
                sampling = SamplingParams(max_tokens=args.tokens, ignore_eos=True, logprobs=k)
                times[name].append(run(engine, prompts, sampling))
    base = statistics.median(times["off"])
    print(f"batch {args.batch}, {args.tokens} tokens, median of {args.repeats}")
    for name, values in times.items():
        ms = statistics.median(values) * 1e3
        print(f"  logprobs {name:7s} {ms:7.2f} ms a step  {ms / (base * 1e3):.3f}x off")


if __name__ == "__main__":
    main()
