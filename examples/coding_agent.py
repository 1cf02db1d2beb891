"""A small coding assistant: read-only tools over a folder, driven turn by turn.

The agent gets three real tools, all confined to one root folder (they resolve every path and
refuse anything outside it; none of them writes):

- ``list_dir(path)``: the entries of a directory,
- ``read_file(path, max_lines)``: the first lines of a text file,
- ``grep(pattern, path)``: regular-expression matches as JSON ``{path, line, text}``.

The default model (SmolLM2-135M-Instruct) does not plan a search on its own, so each tool turn
names the tool with ``tool_choice={"name": ...}`` and the model fills in the arguments: the
grep pattern from the question (turn 1), the file to read from the grep results (turn 2), the
folder to list from the file it read (turn 3). The engine samples under a grammar, so every
call is well-formed and its arguments match the tool's schema (no invented keys, right types).
Each result is fed back with ``add_tool_result`` and goes out with the next turn. The last turn
starts the reply with plain text (``prefill="Summary:"``), which keeps the model from calling
yet another tool and steers it into a summary (``tool_choice="none"`` would only forbid the
call). A wrong value (a path that does not exist) still reaches the tool, whose error goes
back to the model as an error result. Every turn extends the one before, so after the first
turn only the new tokens (tool results, the next question) are computed: see the cache
statistics printed per turn.

``--repeat`` adds a turn that gives the model the first lines of the file it read and asks for
them back: agents re-emit what they read (edits, quotes), and the engine drafts such output from
the context it holds (``SpeculativeConfig``); each turn's line shows its decode rate and the
drafts accepted (``--speculative off`` to compare).

``--tasks examples/coding_tasks`` runs fix-the-bug tasks instead (``_coding_tasks.py``): each
through a Session with list_files / read_file / replace_in_file / write_file / run_tests tools,
with the success rate and tokens per task (``--model qwen2.5-coder-1.5b`` for a coding model;
SmolLM2-135M fixes none; docs/bench/coding-agent-2026-12-03.json has both).

Run on this repository (about 20 s on a 2-core CPU)::

    python examples/coding_agent.py
    python examples/coding_agent.py --root ~/src/other --question '...' --pattern '...'
    python examples/coding_agent.py --repeat --speculative off
    python examples/coding_agent.py --model qwen.gguf --tasks examples/coding_tasks
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import anyio
from _backend import add_backend_argument, open_engine

from agentx import AssistantMessage, SamplingParams, Session, Tool, ToolCall, Usage

REPO_ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", ".venv", "__pycache__", "node_modules", ".ruff_cache", ".pytest_cache"}
MAX_FILE_BYTES = 1_000_000
MAX_MATCHES = 10
MAX_LINE_CHARS = 100
SHOWN_LINES = 12  # of a tool result, on screen; the model gets all of it

SYSTEM = "You are a coding assistant. You answer questions about a Python repository."
QUESTION = "Which file defines the scheduler?"
# Anchored at both ends: only the definition matches, not SchedulerConfig nor this line.
PATTERN = "^class Scheduler:$"
# A constrained call ends with its block: the grammar allows nothing after </tool_call>.
CALL_TURN = SamplingParams(max_tokens=64)
ANSWER_TURN = SamplingParams(max_tokens=64)
REPEAT_TURN = SamplingParams(max_tokens=256)
REPEAT_LINES = 20


class Workspace:
    """The read-only tools, bound to one root folder."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def resolve(self, path: str) -> Path:
        target = (self.root / path).resolve()
        if not target.is_relative_to(self.root):
            raise PermissionError(f"{path!r} is outside the workspace")
        if not target.exists():
            raise FileNotFoundError(f"no such file or directory: {path!r}")
        return target

    def inside(self, path: Path) -> bool:
        """``path``, with every symlink followed, is under the root."""
        return path.resolve().is_relative_to(self.root)

    def show(self, path: Path) -> str:
        return str(path.relative_to(self.root)) or "."

    def visible(self, path: Path) -> bool:
        return not SKIP_DIRS & set(path.relative_to(self.root).parts)

    def list_dir(self, path: str = ".") -> str:
        """List the files and folders of a directory in the repository (for a file: its folder).

        Args:
            path: the directory, relative to the repository root
        """
        folder = self.resolve(path)
        folder = folder if folder.is_dir() else folder.parent
        entries = [p for p in sorted(folder.iterdir()) if self.visible(p)]
        return "\n".join(p.name + ("/" if p.is_dir() else "") for p in entries) or "(empty)"

    def read_file(self, path: str, max_lines: int = 40) -> str:
        """Read the first lines of a text file in the repository.

        Args:
            path: the file, relative to the repository root
            max_lines: how many lines to return at most
        """
        lines = self.resolve(path).read_text(errors="replace").splitlines()
        shown = lines[: max(1, min(max_lines, 80))]
        more = f"\n... ({len(lines) - len(shown)} more lines)" if len(lines) > len(shown) else ""
        return "\n".join(shown) + more

    def grep(self, pattern: str, path: str = ".") -> str:
        """Search the repository's text files for a regular expression.

        Args:
            pattern: a Python regular expression
            path: a file or directory to search, relative to the repository root
        """
        regex = re.compile(pattern)
        matches: list[dict] = []
        for file in self.text_files(self.resolve(path)):
            for number, line in enumerate(file.read_text(errors="replace").splitlines(), 1):
                if regex.search(line) and len(matches) < MAX_MATCHES:
                    text = line.strip()[:MAX_LINE_CHARS]
                    matches.append({"path": self.show(file), "line": number, "text": text})
        # A list of JSON objects, not `file:line: text` lines: the 135M model copies a value
        # it has seen under a "path" key into the next call, but not a path from plain text.
        return json.dumps(matches)

    def text_files(self, target: Path):
        files = [target] if target.is_file() else sorted(target.rglob("*"))
        for file in files:
            if not self.inside(file):  # a symlink out of the root: read_file refuses it too
                continue
            if file.is_file() and self.visible(file) and file.stat().st_size <= MAX_FILE_BYTES:
                if b"\0" not in file.read_bytes()[:1024]:
                    yield file

    def tools(self) -> list[Tool]:
        return [Tool.from_function(f) for f in (self.list_dir, self.read_file, self.grep)]


def cache_line(usage: Usage | None) -> str:
    if usage is None:
        return "(no usage)"
    line = (
        f"prompt {usage.prompt_tokens:4d} | cached {usage.cached_tokens:4d} | "
        f"computed {usage.computed_tokens:4d} | output {usage.output_tokens:3d}"
    )
    if usage.output_tokens_per_s:
        line += f" | {usage.output_tokens_per_s:5.1f} tok/s"
    if usage.draft_tokens:
        line += f" | drafts accepted {usage.accepted_draft_tokens}/{usage.draft_tokens}"
    return line


async def execute(session: Session, call: ToolCall) -> str:
    """Run one call and hand its result to the session (errors go back to the model too)."""
    tool = session.tools.get(call.name)
    if not call.ok or tool is None:  # only when max_tokens cuts a call short
        print(f"  -> {call.raw or call.name}")
        result, is_error = f"error: cannot run {call.name!r}: {call.error or 'no such tool'}", True
    else:
        print(f"  -> {call.name}({call.arguments})")
        try:
            result, is_error = await tool.invoke(call.arguments), False
        except Exception as exc:  # noqa: BLE001 - the model sees the tool's failure
            result, is_error = f"error: {type(exc).__name__}: {exc}", True
    lines = result.splitlines()
    shown = lines[:SHOWN_LINES] + (
        [f"... ({len(lines) - SHOWN_LINES} more lines)"] if len(lines) > SHOWN_LINES else []
    )
    print("  <- " + "\n     ".join(shown))
    session.add_tool_result(call.id, result, is_error=is_error)
    return result


async def turn(
    session: Session, label: str, message=None, tool_choice=None, prefill=None, sampling=None
) -> AssistantMessage:
    sampling = sampling or (CALL_TURN if tool_choice else ANSWER_TURN)
    print(f"\n[{label}] " + (f"user: {message}" if message else "(sends the tool results)"))
    if tool_choice:
        print(f"[{label}] tool_choice={tool_choice!r}")
    if prefill:
        print(f"[{label}] reply prefilled with {prefill!r}")
    reply = await session.send(message, tool_choice=tool_choice, prefill=prefill, sampling=sampling)
    if reply.content.strip():
        print(f"[{label}] assistant: {reply.content.strip()}")
    print(f"[{label}] {cache_line(reply.usage)}")
    for call in reply.tool_calls:
        await execute(session, call)
    return reply


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="folder the tools may read")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--pattern", default=PATTERN, help="the grep pattern the user suggests")
    parser.add_argument("--repeat", action="store_true", help="a last turn re-emits the file")
    parser.add_argument("--tasks", type=Path, help="a folder of fix-the-bug tasks to run")
    parser.add_argument("--task", action="append", default=[], help="only this task (repeatable)")
    parser.add_argument("--max-turns", type=int, default=10, help="turns per task")
    parser.add_argument("--max-tokens", type=int, default=256, help="output tokens per turn")
    parser.add_argument("--transcript", action="store_true", help="print every task's turns")
    parser.add_argument("--json", type=Path, help="write the per-task results here")
    add_backend_argument(parser)
    args = parser.parse_args()
    with open_engine(args.backend, args.speculative, args.model) as engine:
        if args.tasks is not None:
            from _coding_tasks import run_tasks

            await run_tasks(
                engine,
                args.tasks,
                args.task,
                args.max_turns,
                args.max_tokens,
                args.transcript,
                args.json,
            )
        else:
            await agent(engine, args)


async def agent(engine, args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    workspace = Workspace(args.root)
    async with Session(engine, tools=workspace.tools(), system=SYSTEM, sampling=ANSWER_TURN) as s:
        print(f"model loaded in {time.perf_counter() - t0:.1f}s; workspace: {workspace.root}")
        print(f"tools: {', '.join(s.tools)}")

        # Turn 1: the model fills in the grep pattern.
        task = f'{args.question} Use grep with the pattern "{args.pattern}".'
        await turn(s, "turn 1", task, tool_choice={"name": "grep"})
        # Turn 2: the model picks the file to read from the grep results it was just sent.
        reply = await turn(s, "turn 2", tool_choice={"name": "read_file"})
        # Turn 3: a look around the file it read; the model names the folder to list.
        read = [c.arguments["path"] for c in reply.tool_calls if "path" in c.arguments]
        if read:
            look = f"What else is in the folder of {read[0]}?"
            await turn(s, "turn 3", look, tool_choice={"name": "list_dir"})
        # Last turn: a plain-text prefill keeps the model from calling another tool.
        ask = f"{args.question} Summarize what you found."
        await turn(s, "turn 4", ask, prefill="Summary:")
        if args.repeat and read:
            # the 135M model asks read_file for a line or two: the user pastes more of the file
            lines = workspace.read_file(read[0], max_lines=REPEAT_LINES)
            again = f"Here is {read[0]}:\n```python\n{lines}\n```\nWrite it out again, exactly."
            await turn(s, "turn 5", again, prefill="```python\n", sampling=REPEAT_TURN)

        print("\nper-turn cache statistics:")
        assistant_turns = [m for m in s.messages if m.role == "assistant"]
        for i, message in enumerate(assistant_turns, start=1):
            print(f"  turn {i}: {cache_line(message.usage)}")
        print(f"  total:  {cache_line(s.total_usage)}")
    print(f"done in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    anyio.run(main)
