"""Speculative decoding from context (engine/draft.py): decode speed and acceptance, on and off.

Three cases, each run on a fresh engine with drafting off, then on (same config otherwise):

    repeat_file   a coding-agent turn asked to repeat a file it was shown (a tool result),
                  the reply started with the file's first line (as coding_agent.py prefills)
    fanout        an eval fan-out: a parent session's task, forked; each subagent restates it
                  (drafts from its own context and its siblings' outputs)
    random        random-token prompts, greedy, EOS ignored, batched, like the synthetic AgentX
                  trace's prompts (greedy continuations of them fall into loops the request's
                  own index predicts, so drafts pay here too)
    sampled       the same prompts sampled at temperature 1 (seeded): continuations that do
                  not repeat, so this shows the cost of drafting that does not pay

Decode tok/s is output tokens after the first over the time after the first token, summed over
the case's turns. Prints a Markdown table headed by the exact command.

    python benchmarks/spec_decode_bench.py               # the full sizes (a few minutes)
    python benchmarks/spec_decode_bench.py --quick       # a smoke run
"""

# ruff: noqa: E402 - OMP_WAIT_POLICY must be set before torch is imported

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import random
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams, Session, SpeculativeConfig

REPO = Path(__file__).resolve().parent.parent
FILE = REPO / "agentx" / "engine" / "kv_cache" / "block_pool.py"
TASK = (
    "Write a Python function parse_duration(text) that turns strings such as '1h30m', '45s' "
    "and '2h' into a number of seconds, raising ValueError on anything else."
)


@dataclass(slots=True)
class Result:
    output_tokens: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    wall_s: float = 0.0
    draft: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


async def timed_turn(session: Session, result: Result, message: str, **kw) -> str:
    """One turn; adds its decode tokens and time after the first token to ``result``."""
    start, first, num = time.perf_counter(), None, 0
    async with session.stream(message, **kw) as turn:
        async for event in turn:
            if event.type == "text.delta" and first is None:
                first = time.perf_counter()
        msg = await turn.get_final_message()
    num = msg.usage.output_tokens
    end = time.perf_counter()
    result.output_tokens += num
    if first is not None and num > 1:
        result.decode_tokens += num - 1
        result.decode_s += end - first
    result.wall_s += end - start
    return msg.content or ""


async def repeat_file(engine: Engine, args: argparse.Namespace, result: Result) -> None:
    lines = FILE.read_text().splitlines()[: args.file_lines]
    text = "\n".join(lines)
    sampling = SamplingParams(max_tokens=args.max_tokens)
    async with Session(engine, system="You are a coding assistant.") as s:
        await s.send("Show me the start of block_pool.py.", sampling=SamplingParams(max_tokens=4))
        msg = f"Here is agentx/engine/kv_cache/block_pool.py:\n```python\n{text}\n```\n"
        await timed_turn(
            s,
            result,
            msg + "Repeat the file exactly.",
            sampling=sampling,
            prefill="```python\n" + lines[0] + "\n",
        )


async def fanout(engine: Engine, args: argparse.Namespace, result: Result) -> None:
    sampling = SamplingParams(max_tokens=args.max_tokens)
    async with Session(engine, system="You are a careful Python programmer.") as s:
        await s.send(f"Task: {TASK}\nSay OK.", sampling=SamplingParams(max_tokens=4))
        children = await s.fork(args.num_forks)
        for child in children:  # one after another: later ones draft from earlier outputs
            await timed_turn(
                child,
                result,
                "Restate the task word for word, then solve it.",
                sampling=sampling,
                prefill="Task:",
            )


async def random_prompts(
    engine: Engine, args: argparse.Namespace, result: Result, temperature: float = 0.0
) -> None:
    rng = random.Random(0)
    vocab = engine.core.spec.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(4)]

    async def one(i: int, prompt: list[int]) -> None:
        sampling = SamplingParams(
            max_tokens=args.max_tokens, ignore_eos=True, temperature=temperature, seed=i
        )
        start, first, num = time.perf_counter(), None, 0
        async for out in engine.stream(prompt, sampling):
            num += len(out.new_token_ids)
            if first is None and out.new_token_ids:
                first = time.perf_counter()
        end = time.perf_counter()
        result.output_tokens += num
        result.decode_tokens += num - 1
        result.decode_s += end - first
        result.wall_s += end - start

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


async def sampled_prompts(engine: Engine, args: argparse.Namespace, result: Result) -> None:
    await random_prompts(engine, args, result, temperature=1.0)


CASES: dict[str, Callable] = {
    "repeat_file": repeat_file,
    "fanout": fanout,
    "random": random_prompts,
    "sampled": sampled_prompts,
}


def run_case(name: str, enabled: bool, args: argparse.Namespace) -> Result:
    config = EngineConfig(
        cache=CacheConfig(kv_cache_bytes=256 << 20),
        quantization=args.quantization,
        speculative=SpeculativeConfig(enabled=enabled),
    )
    engine = Engine(config)
    try:
        engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2))  # warm
        before = engine.stats()
        result = Result()
        asyncio.run(CASES[name](engine, args, result))
        stats = engine.stats()
        result.draft = stats.num_draft_tokens - before.num_draft_tokens
        result.accepted = stats.num_accepted_tokens - before.num_accepted_tokens
        result.steps = stats.num_steps - before.num_steps
        return result
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--max-tokens", type=int, default=None)
    args = parser.parse_args()
    args.max_tokens = args.max_tokens or (96 if args.quick else 384)
    args.file_lines = 40 if args.quick else 120
    args.num_forks = 2 if args.quick else 4
    args.prompt_tokens = 256 if args.quick else 2048
    print(f"`{shlex.join([Path(sys.executable).name, *sys.argv])}`\n")
    print("| case | drafting | output tok | steps | decode tok/s | drafted | accepted | accept |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in args.only:
        base = None
        for enabled in (False, True):
            r = run_case(name, enabled, args)
            rate = f"{r.accepted / r.draft:.0%}" if r.draft else "-"
            speed = f"{r.decode_tok_s:.1f}"
            if base is not None and base.decode_tok_s:
                speed += f" ({r.decode_tok_s / base.decode_tok_s:.2f}x)"
            print(
                f"| {name} | {'on' if enabled else 'off'} | {r.output_tokens} | {r.steps} | "
                f"{speed} | {r.draft} | {r.accepted} | {rate} |",
                flush=True,
            )
            base = r


if __name__ == "__main__":
    main()
