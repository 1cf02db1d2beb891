"""Budget-aware grammars: the share of valid tool calls with and without the budget, and what
the budget costs per step.

    python benchmarks/grammar_budget_bench.py [--seeds 30] [--max-tokens 160] [--timing]

The issue's case: a patch tool with unbounded strings and lists (``path: str``, ``mode:
Literal[...]``, ``hunks: list[Hunk]``, ``Hunk`` = ``start_line: int`` + ``replacement:
list[str]``), ``tool_choice="required"``, temperature 1.0, seeds ``0..N-1``, on the default
model. A turn counts as valid when it made at least one call and every call parses and its
arguments validate. "before" is the same run with the budget switched off (matchers built
without ``max_tokens``, as before budgets existed).

``--timing`` replays every turn's output tokens through a plain matcher (fill the mask, consume)
and through a budgeted one (fill the mask, commit), and reports the mean time per step of each
and their difference: the per-step cost of the budget on the grammar side, off the model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from typing import Literal

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pydantic import BaseModel, validate_call  # noqa: E402

from agentx import Engine, EngineConfig, SamplingParams, Session  # noqa: E402
from agentx.engine import structured  # noqa: E402
from agentx.session.constraints import tool_call_grammar  # noqa: E402
from agentx.session.tools import make_tools  # noqa: E402

ASK = "In src/app.py, replace lines 3 and 7 with a logging call and a docstring."


class Hunk(BaseModel):
    start_line: int
    replacement: list[str]


def patch(path: str, mode: Literal["replace", "insert", "delete"], hunks: list[Hunk]) -> str:
    """Patch a file."""
    return f"{mode} {path}: {len(hunks)} hunks"


def is_valid(reply) -> bool:
    validate = validate_call(patch)
    if not reply.tool_calls or not all(call.ok for call in reply.tool_calls):
        return False
    try:
        for call in reply.tool_calls:
            validate(**call.arguments)
    except ValueError:
        return False
    return True


async def run_turns(engine: Engine, seeds: int, max_tokens: int) -> list:
    async with Session(engine, tools=[patch]) as base:

        async def turn(seed: int):
            async with await base.fork() as s:
                sampling = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens)
                return await s.send(ASK, tool_choice="required", sampling=sampling)

        return await asyncio.gather(*(turn(seed) for seed in range(seeds)))


def without_budget():
    """Patch the grammar backend to build matchers as before budgets (no max_tokens)."""
    original = structured.GrammarBackend.new_matcher

    def new_matcher(self, spec, max_tokens=None):
        return original(self, spec)

    structured.GrammarBackend.new_matcher = new_matcher
    return lambda: setattr(structured.GrammarBackend, "new_matcher", original)


def replay_timing(engine: Engine, outputs: list[list[int]], max_tokens: int) -> tuple:
    """Mean microseconds per step (mask + consume) without and with the budget."""
    backend = engine.core._grammar_backend()
    spec = tool_call_grammar(list(make_tools([patch]).values()), "required")
    bitmask = backend.allocate_bitmask(1)
    outputs = [ids for ids in outputs if _accepted(backend.new_matcher(spec), ids)]
    per_step = []
    for budgeted in (False, True):
        steps, elapsed = 0, 0.0
        for token_ids in outputs:
            matcher = backend.new_matcher(spec, max_tokens if budgeted else None)
            t0 = time.perf_counter()
            for token_id in token_ids:
                matcher.fill_bitmask(bitmask, 0)
                matcher.commit(token_id)
            elapsed += time.perf_counter() - t0
            steps += len(token_ids)
        per_step.append(elapsed / steps * 1e6)
    return tuple(per_step)


def _accepted(matcher, token_ids: list[int]) -> bool:
    """The grammar takes ``token_ids`` as they are (a re-tokenized call may differ from what
    the model wrote, e.g. a number's spelling)."""
    return all(matcher.accept(t) for t in token_ids) and matcher.is_accepting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--timing", action="store_true")
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    with Engine(EngineConfig()) as engine:
        restore = without_budget()
        before = asyncio.run(run_turns(engine, args.seeds, args.max_tokens))
        restore()
        after = asyncio.run(run_turns(engine, args.seeds, args.max_tokens))
        print(f"patch tool, seeds 0-{args.seeds - 1}, max_tokens {args.max_tokens}:")
        print("| run | valid turns | finish stop | finish length |")
        print("|---|---|---|---|")
        for name, replies in (("before (no budget)", before), ("after (budget)", after)):
            valid = sum(is_valid(r) for r in replies)
            stops = sum(r.finish_reason == "stop" for r in replies)
            print(f"| {name} | {valid}/{len(replies)} | {stops} | {len(replies) - stops} |")
        if args.timing:
            outputs = [call_ids(engine, r) for r in after if is_valid(r)]
            plain, budgeted = replay_timing(engine, outputs, args.max_tokens)
            print(
                f"per step (mask + consume, replayed): plain {plain:.0f} us, budgeted "
                f"{budgeted:.0f} us, +{budgeted - plain:.0f} us"
            )


def call_ids(engine: Engine, reply) -> list[int]:
    """A reply's calls as the grammar writes them, tokenized."""
    entries = [{"name": c.name, "arguments": c.arguments} for c in reply.tool_calls]
    return engine.tokenizer.encode(f"<tool_call>{json.dumps(entries)}</tool_call>")


if __name__ == "__main__":
    main()
