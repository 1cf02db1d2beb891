"""Perplexity of real text with an fp32, a bf16 and an int8 KV cache
(``CacheConfig.kv_cache_dtype``).

The text is a Python standard-library source file (``textwrap.py`` by default: code, comments
and docstrings), cut into windows of ``--window`` tokens; each window is one prompt whose every
token's logprob comes back (``SamplingParams.prompt_logprobs``), computed by attention that
reads the keys and values back from the paged cache, so every position after the first sees its
context through the cache's element type. Perplexity is exp of the mean negative logprob over
every predicted token; it also gives the share of positions where each cache's top-1
prediction is the fp32 cache's (bf16 against fp32 is the scale for int8 against fp32).

    python benchmarks/kv_int8_perplexity.py
    python benchmarks/kv_int8_perplexity.py --file /path/to/text --kb 16 --quantization none
    python benchmarks/kv_int8_perplexity.py --model qwen2.5-coder-1.5b   # the coding model
"""

# ruff: noqa: E402

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import math
import sysconfig
from pathlib import Path

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams


def windows(engine: Engine, text: str, size: int) -> list[list[int]]:
    ids = engine.tokenizer.encode(text)
    return [ids[i : i + size] for i in range(0, len(ids) - 1, size) if len(ids[i:]) > 1]


def score(
    dtype: str, quantization: str, text: str, size: int, model: str | None = None
) -> tuple[float, int, list[int]]:
    """(perplexity, tokens predicted, each position's top-1 token) for one KV element type."""
    config = EngineConfig(
        **({} if model is None else {"model": model}),
        quantization=quantization,
        cache=CacheConfig(kv_cache_bytes=256 << 20, kv_cache_dtype=dtype),
    )
    sampling = SamplingParams(max_tokens=1, prompt_logprobs=1)
    total, count, top1 = 0.0, 0, []
    with Engine(config) as engine:
        for prompt in windows(engine, text, size):
            gen = engine.generate([prompt], sampling)[0]
            for record in gen.prompt_logprobs or ():
                if record is None:  # the first token: nothing predicts it
                    continue
                total -= record.logprob
                count += 1
                top1.append(record.top[0][0])
    return math.exp(total / count), count, top1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    parser.add_argument("--file", type=Path, default=default)
    parser.add_argument("--kb", type=int, default=12, help="KB of the file's start to score")
    parser.add_argument("--window", type=int, default=1024, help="tokens a prompt")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--model", default=None, help="EngineConfig.model (default: embedded)")
    args = parser.parse_args()
    text = args.file.read_text()[: args.kb * 1024]
    dtypes = ("float32", "bfloat16", "int8")
    results = {dt: score(dt, args.quantization, text, args.window, args.model) for dt in dtypes}
    print(
        f"{args.model or 'embedded model'}, {args.file.name}: first {len(text)} chars, windows "
        f"of {args.window} tokens, quantization={args.quantization}"
    )
    print("| KV cache | tokens | perplexity | top-1 as fp32's |")
    print("|---|---|---|---|")
    base = results["float32"][2]
    for dt, (ppl, count, top1) in results.items():
        same = sum(x == y for x, y in zip(base, top1, strict=True))
        print(f"| {dt} | {count} | {ppl:.4f} | {100 * same / count:.2f}% |")


if __name__ == "__main__":
    main()
