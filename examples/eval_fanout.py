"""An eval harness: one shared context, N subagents forked from it, answers scored.

The parent session reads a short passage in its first turn. ``fork(n)`` then makes N children
that continue from that exact context and share its KV by reference: each child's first turn
computes only its own question (a few dozen tokens) and takes the passage from the cache, so its
``cached_tokens`` is about the size of the parent's context. The N questions run concurrently
in one anyio task group, so the engine batches their decodes. Each answer is scored against an
expected one (exact match and substring, after lower-casing and dropping punctuation); the
135M default model gets some wrong, and the harness only reports.

Run with ``python examples/eval_fanout.py`` (about 15 s on a 2-core CPU for the default 4
questions); ``--n 8`` asks all eight.
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass

import anyio
from _backend import add_backend_argument, open_engine

from agentx import SamplingParams, Session, Usage

PASSAGE = """\
The Karrow Point lighthouse stands on the northern tip of Ilsa Island. It was designed by the \
engineer Mara Lind and first lit in 1874. The tower is 38 metres tall and is painted in red and \
white bands. Its lamp burned whale oil until 1931, when it was converted to electricity; the \
beam can be seen 22 nautical miles away. The last keeper, Tomas Vey, left in 1989, when the \
light became automatic. Today the keeper's cottage is a small museum that opens only in summer."""

SYSTEM = "You answer questions about a passage with a few words taken from the passage."

# (question, expected answer)
CASES = [
    ("Who designed the lighthouse?", "Mara Lind"),
    ("In what year was the lighthouse first lit?", "1874"),
    ("How tall is the tower in metres?", "38"),
    ("Who was the last keeper?", "Tomas Vey"),
    ("What colours is the tower painted?", "red and white"),
    ("In what year was the lamp converted to electricity?", "1931"),
    ("How many nautical miles away can the beam be seen?", "22"),
    ("What is the keeper's cottage today?", "a museum"),
]


@dataclass(frozen=True, slots=True)
class Result:
    question: str
    expected: str
    answer: str
    usage: Usage

    @property
    def exact(self) -> bool:
        return normalize(self.answer) == normalize(self.expected)

    @property
    def contains(self) -> bool:
        return normalize(self.expected) in normalize(self.answer)


def normalize(text: str) -> str:
    words = re.sub(r"[^\w\s]", " ", text.lower()).split()
    return " ".join(w for w in words if w not in ("a", "an", "the"))


def cache_line(usage: Usage) -> str:
    return (
        f"prompt {usage.prompt_tokens:4d} | cached {usage.cached_tokens:4d} | "
        f"computed {usage.computed_tokens:3d} | output {usage.output_tokens:3d}"
    )


async def ask_all(parent: Session, cases: list[tuple[str, str]], sampling) -> list[Result]:
    """Fork one child per case and ask all the questions at once."""
    children = await parent.fork(len(cases))
    results: list[Result | None] = [None] * len(cases)

    async def ask(i: int) -> None:
        question, expected = cases[i]
        reply = await children[i].send(question, sampling=sampling)
        results[i] = Result(question, expected, reply.content.strip(), reply.usage)
        await children[i].close()  # its KV goes back now, not when the parent closes

    async with anyio.create_task_group() as tg:
        for i in range(len(cases)):
            tg.start_soon(ask, i)
    return results


def report(results: list[Result], context_size: int) -> None:
    for i, r in enumerate(results, start=1):
        verdict = "exact" if r.exact else "contains" if r.contains else "wrong"
        print(f"[{i}] Q: {r.question}")
        print(f"    A: {r.answer!r}   expected {r.expected!r}: {verdict}")
        share = r.usage.cached_tokens / context_size
        print(f"    {cache_line(r.usage)}  ({share:.0%} of the shared context from cache)")
    n = len(results)
    print(
        f"\nscore: {sum(r.exact for r in results)}/{n} exact, "
        f"{sum(r.contains for r in results)}/{n} contain the expected answer"
    )
    computed = sum(r.usage.computed_tokens for r in results)
    prompts = sum(r.usage.prompt_tokens for r in results)
    print(
        f"children computed {computed} of their {prompts} prompt tokens "
        f"({computed / prompts:.0%}); the rest came from the parent's KV"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4, help=f"subagents, 1-{len(CASES)}")
    parser.add_argument("--max-tokens", type=int, default=24, help="per answer")
    add_backend_argument(parser)
    args = parser.parse_args()
    if not 1 <= args.n <= len(CASES):
        parser.error(f"--n must be between 1 and {len(CASES)}")
    with open_engine(args.backend, args.speculative) as engine:
        await evaluate(engine, args)


async def evaluate(engine, args: argparse.Namespace) -> None:
    answer_sampling = SamplingParams(max_tokens=args.max_tokens, stop=("\n",))

    t0 = time.perf_counter()
    async with Session(engine, system=SYSTEM, sampling=SamplingParams(max_tokens=16)) as s:
        print(f"model loaded in {time.perf_counter() - t0:.1f}s\n")

        # Turn 1: the shared context. Everything the children need is in the KV after it.
        t1 = time.perf_counter()
        read = await s.send(f"Read this passage; questions about it follow.\n\n{PASSAGE}")
        print(f"parent, turn 1 (reads the passage): {read.content.strip()!r}")
        print(f"    {cache_line(read.usage)}  ({time.perf_counter() - t1:.1f}s)")
        context_size = read.usage.prompt_tokens + read.usage.output_tokens

        t2 = time.perf_counter()
        results = await ask_all(s, CASES[: args.n], answer_sampling)
        elapsed = time.perf_counter() - t2
        print(
            f"\n{args.n} subagents forked from a {context_size}-token context, in {elapsed:.1f}s:"
        )
        report(results, context_size)
        print(f"session total (parent + children): {cache_line(s.total_usage)}")
    print(f"done in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    anyio.run(main)
