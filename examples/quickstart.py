"""Quickstart: an agent session that streams, calls a Python tool, forks two subagents and joins.

What it shows, on the embedded SmolLM2-135M-Instruct (loaded once, shared process-wide):

1. a streamed turn with ``tool_choice={"name": "add"}``: the engine samples only what a call to
   ``add`` with valid arguments allows, so even the tiny model always writes one; the call
   arrives as a ``tool_call`` event;
2. the tool run as plain Python and its result fed back with ``add_tool_result``;
3. a streamed turn that continues from the result;
4. ``fork(2)``: two subagents answer different follow-ups concurrently (one anyio task group);
   each child starts on the parent's KV, so its first turn computes only its new tokens;
5. ``join``: the children's answers come back as one user message for the parent's next turn;
6. per-turn cache statistics (prompt / cached / computed tokens) and the session's total usage,
   then the raw batch API, ``Engine.generate``, on the same engine.

Run with ``make demo`` (creates .venv on first use) or ``python examples/quickstart.py``.
Takes about 20 s on a 2-core CPU.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402

import anyio  # noqa: E402
from _backend import add_backend_argument, open_engine  # noqa: E402

from agentx import SamplingParams, Session, Usage  # noqa: E402

T_IMPORTED = time.perf_counter()

# A constrained call ends with its block: the grammar allows nothing after </tool_call>.
CALL_TURN = SamplingParams(max_tokens=40)
ANSWER_TURN = SamplingParams(max_tokens=40)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def cache_line(usage: Usage | None) -> str:
    if usage is None:
        return "(no usage)"
    rate = f", {usage.output_tokens_per_s:.1f} tok/s" if usage.output_tokens_per_s else ""
    ttft = f", ttft {usage.ttft_s:.2f}s" if usage.ttft_s is not None else ""
    return (
        f"prompt {usage.prompt_tokens:4d} | cached {usage.cached_tokens:4d} | "
        f"computed {usage.computed_tokens:4d} | output {usage.output_tokens:3d}{ttft}{rate}"
    )


async def streamed_turn(session: Session, label: str, message=None, **kwargs):
    """One turn streamed to stdout; returns the assistant message."""
    print(f"\n[{label}] user: {message}" if message else f"\n[{label}] (sends the tool results)")
    if kwargs.get("tool_choice"):
        print(f"[{label}] (tool_choice={kwargs['tool_choice']!r})")
    print(f"[{label}] assistant: ", end="", flush=True)
    async with session.stream(message, **kwargs) as turn:
        async for event in turn:
            if event.type == "text.delta":
                print(event.text, end="", flush=True)
            elif event.type == "tool_call":
                call = event.call
                shown = call.arguments if call.ok else f"<malformed: {call.error}>"
                print(f"\n[{label}]   -> tool call {call.name}({shown})", end="")
            elif event.type == "turn.done":
                print(f"\n[{label}]   {cache_line(event.usage)}")
        return await turn.get_final_message()


async def run_tools(session: Session, reply) -> None:
    """Run each call's Python function; the results go out with the next turn."""
    for call in reply.tool_calls:
        tool = session.tools.get(call.name)
        if not call.ok or tool is None:
            result, is_error = f"error: cannot run {call.name!r} ({call.error})", True
        else:
            result, is_error = await tool.invoke(call.arguments), False
        print(f"  <- {call.name} returned {result}")
        session.add_tool_result(call.id, result, is_error=is_error)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_backend_argument(parser)
    args = parser.parse_args()
    t0 = time.perf_counter()
    with open_engine(args.backend, args.speculative) as engine:
        await session_demo(engine, t0)
    print(f"done in {time.perf_counter() - t0:.1f}s")


async def session_demo(engine, t0: float) -> None:
    async with Session(engine, tools=[add, multiply], sampling=ANSWER_TURN) as s:
        t_loaded = time.perf_counter()
        # Not needed (a turn sent now waits for what it needs); here so that turn 1's numbers
        # are those of any cold turn: the engine warms up and builds its tables at start.
        await anyio.to_thread.run_sync(s.engine.wait_ready)
        print(
            f"import agentx {T_IMPORTED - T_START:.1f}s, model loaded in {t_loaded - t0:.1f}s, "
            f"warmed up {time.perf_counter() - t_loaded:.1f}s later; tools: {', '.join(s.tools)}"
        )

        # 1-3: a tool call (forced by tool_choice), its result, and the answer that uses it.
        reply = await streamed_turn(
            s, "turn 1", "What is 17 + 25?", tool_choice={"name": "add"}, sampling=CALL_TURN
        )
        await run_tools(s, reply)
        await streamed_turn(s, "turn 2")

        # 4: two subagents, forked from the exact context so far, answer concurrently.
        questions = ["Is the result even or odd?", "Write the result in words."]
        children = await s.fork(len(questions))
        print(f"\nforked {len(children)} subagents; they run concurrently:")
        replies = [None] * len(children)

        async def ask(i: int) -> None:
            replies[i] = await children[i].send(questions[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(children)):
                tg.start_soon(ask, i)
        for i, reply in enumerate(replies):
            print(f"[child {i + 1}] user: {questions[i]}")
            print(f"[child {i + 1}] assistant: {reply.content.strip()}")
            print(f"[child {i + 1}]   {cache_line(reply.usage)}")

        # 5: fold the answers back into the parent as one user message, then continue.
        answers = await s.join(children)
        print("\njoined: the parent's next turn gets one user message:")
        print(
            "  Subagent results:\n" + "\n".join(f"  [{i + 1}] {a}" for i, a in enumerate(answers))
        )
        await streamed_turn(s, "turn 3", "Summarize the subagent results in one sentence.")

        # 6: per-turn statistics for the parent, and the whole tree's total.
        print("\nparent turns:")
        turns = [m for m in s.messages if m.role == "assistant"]
        for i, message in enumerate(turns, start=1):
            print(f"  turn {i}: {cache_line(message.usage)}")
        print(f"own usage:   {cache_line(s.usage)}")
        print(f"total usage: {cache_line(s.total_usage)}  (parent + subagents)")

        # The raw engine API underneath: a batch of plain completions, no chat template.
        # ``generate`` blocks until done, so async code runs it in a worker thread.
        engine = s.engine
        prompts = ["The capital of France is", "def fibonacci(n):"]
        gens = await anyio.to_thread.run_sync(
            engine.generate, prompts, SamplingParams(max_tokens=16)
        )
        print("\nEngine.generate:")
        for prompt, gen in zip(prompts, gens, strict=True):
            print(f"  {prompt!r} -> {gen.text!r} ({gen.usage.output_tokens} tokens)")
        stats = engine.stats()
        print(
            f"engine prefix cache: {stats.num_cached_tokens}/"
            f"{stats.prefix_cache_query_tokens} prompt tokens reused"
        )


if __name__ == "__main__":
    anyio.run(main)
