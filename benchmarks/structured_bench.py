"""Constrained decoding overhead: decode steps with and without a grammar, at batch 1 and 32.

    python benchmarks/structured_bench.py [--tokens 64]

Every request decodes ``--tokens`` tokens (greedy, ``ignore_eos``) after a 128-token random
prompt. The constrained run puts each request inside a JSON string field (a grammar state that
needs a full-vocabulary mask every step) so every step computes and applies a bitmask per row.
Reports the mean decode step time (prefill excluded: timed from the step after every request
has its first token) and decode tokens/s, unconstrained vs constrained, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from agentx import CacheConfig, EngineConfig, SamplingParams  # noqa: E402
from agentx.engine.core import EngineCore  # noqa: E402
from agentx.engine.structured import StructuredOutput  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 4000}},
    "required": ["text"],
}


def decode_steps(core: EngineCore, batch: int, tokens: int, structured, seed: int) -> tuple:
    rng = random.Random(seed)
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True, structured=structured)
    for i in range(batch):
        prompt = [rng.randrange(100, 49152) for _ in range(128)]
        core.add_request(core.make_request(f"s{seed}-{i}", prompt, sampling))
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
        core.step()
    steps, t0 = 0, time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    elapsed = time.perf_counter() - t0
    return elapsed / steps * 1e3, batch * steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    core = EngineCore(EngineConfig(cache=CacheConfig(kv_cache_bytes=1 << 30)))
    decode_steps(core, 2, 8, None, seed=99)  # warm up both paths
    decode_steps(core, 2, 8, StructuredOutput(json_schema=SCHEMA), seed=98)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), fp32"
    )
    print(
        "| batch | step ms (free) | step ms (grammar) | overhead per step | tok/s free "
        "| tok/s grammar | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for i, batch in enumerate((1, 32)):
        free_ms, free_tps = decode_steps(core, batch, args.tokens, None, seed=2 * i)
        grammar = StructuredOutput(json_schema=SCHEMA)
        g_ms, g_tps = decode_steps(core, batch, args.tokens, grammar, seed=2 * i + 1)
        print(
            f"| {batch} | {free_ms:.1f} | {g_ms:.1f} | {g_ms - free_ms:+.1f} ms "
            f"({(g_ms / free_ms - 1) * 100:+.0f}%) | {free_tps:.1f} | {g_tps:.1f} "
            f"| {g_tps / free_tps:.2f}x |"
        )


if __name__ == "__main__":
    main()
