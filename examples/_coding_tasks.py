"""``coding_agent.py --tasks``: fix-the-bug tasks, each run through one Session with tools.

A task is a folder (``examples/coding_tasks/NN_name/``) holding a tiny Python module with one
bug, a failing pytest test and ``TASK.md`` (what is wrong). Each task runs in a temporary copy,
so the folders stay broken for the next run. The agent gets five tools over that copy:

- ``list_files()``: the files of the task,
- ``read_file(path)``: one file's text,
- ``replace_in_file(path, old, new)``: an exact edit (``old`` must occur once),
- ``write_file(path, content)``: replace one whole file (only files that exist),
- ``run_tests()``: ``pytest`` in the copy (a subprocess, no third-party plugins): PASSED, or
  FAILED with the short traceback and summary lines only.

Why these shapes (from the transcripts of Qwen2.5-Coder-1.5B): asked to rewrite a whole file
it renames the function it fixes, so the precise ``replace_in_file`` comes first; pytest's
plugin warnings and progress bars buried the one ``E`` line that says what is wrong; it edited
a test to match the bug and made edits that change nothing, which the tools now refuse; it
never read a file again after editing it, so an edit answers with the edited lines (numbered,
with two around them), and an ambiguous `old` with the lines it occurs on; after
a PASSED it kept editing and testing until the turn limit, so the loop ends at the first passing
``run_tests`` (as a CI gate would); offered ``tool_choice="auto"`` it wrote a plan in prose with
imagined file contents instead of reading them, so every turn must be a call (``"required"``),
and one call only: allowed several, it queued four edits before reading the file they edit.
Greedy, it also repeated a refused call verbatim until the turn limit: a call that repeats the
previous turn's is answered with its result and a note that it is a repeat, and the next turn
samples (temperature ``RETRY_TEMPERATURE``, seeded by the turn, so runs are reproducible)
instead of decoding greedily into the same reply.

The loop calls tools until the tests pass or the turn limit is reached; then the tests run once
more and decide success. ``transcript=True`` prints each turn: the raw reply, the parsed calls
and the tool results.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentx import SamplingParams, Session, Tool

SYSTEM = (
    "You are a careful Python developer fixing a bug in a small project through tools. Read "
    "the code file and its test file with read_file, find the line that makes the test fail, "
    "fix that line with replace_in_file (`old`: the line copied exactly; `new`: the fixed "
    "line; keep every name as it is), then call run_tests. If they fail, read the error and "
    "fix again."
)
TEST_TIMEOUT_S = 60
OUTPUT_TAIL_CHARS = 1200
LAST_REPLY_CHARS = 300  # of a failed task's last reply, on screen
PASSED = "PASSED"
# Every turn is a call, written under the format's grammar: offered "auto", Qwen2.5-Coder
# answers the task with a plan in prose and imagined file contents (512 tokens, no call).
TOOL_CHOICE = "required"
RETRY_TEMPERATURE = 0.7  # the turn after a repeated call
EDIT_CONTEXT_LINES = 2  # an edit's result shows the edited lines and this many around them
REPEAT_NOTE = "\n(note: this is the same call as your previous turn; try something different)"


class TaskWorkspace:
    """A temporary copy of one task folder and the tools that act on it."""

    def __init__(self, task: Path) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=f"agentx-{task.name}-"))
        shutil.copytree(task, self.root, dirs_exist_ok=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _path(self, path: str) -> Path:
        resolved = (self.root / path).resolve()
        if self.root.resolve() not in resolved.parents:
            raise ValueError(f"{path!r} is outside the task folder")
        return resolved

    def _existing(self, path: str) -> Path:
        target = self._path(path)
        if not target.is_file():
            files = self.list_files().replace("\n", ", ")
            raise ValueError(f"{path!r} does not exist (files: {files})")
        return target

    def _editable(self, path: str) -> Path:
        target = self._existing(path)
        if target.name.startswith("test_"):
            raise ValueError(f"{path} is a test: the tests say what is right; fix the code")
        return target

    def list_files(self) -> str:
        """List the files of the task."""
        return "\n".join(sorted(p.name for p in self.root.iterdir() if p.is_file()))

    def read_file(self, path: str) -> str:
        """Read one file of the task.

        Args:
            path: the file name, e.g. "mathutil.py".
        """
        return self._existing(path).read_text()

    def replace_in_file(self, path: str, old: str, new: str) -> str:
        """Replace one exact piece of text in a file (e.g. the buggy line) with new text.

        Args:
            path: the file name, e.g. "mathutil.py".
            old: the text to replace, copied exactly from the file; it must occur once.
            new: the text to put in its place.
        """
        target = self._editable(path)
        if old == new:
            raise ValueError("`new` is the same as `old`: nothing would change")
        text = target.read_text()
        count = text.count(old) if old else 0
        if count == 0:
            raise ValueError(f"`old` does not occur in {path}; copy it exactly from read_file")
        if count > 1:
            lines = [n for n, line in enumerate(text.splitlines(), 1) if old in line]
            raise ValueError(
                f"`old` occurs {count} times in {path} (lines {', '.join(map(str, lines))}); "
                "include a neighbouring line in `old` so that it occurs once"
            )
        start = text.index(old)
        edited = text.replace(old, new)
        target.write_text(edited)
        first = text.count("\n", 0, start) + 1
        return f"replaced 1 occurrence in {path}; now:\n" + _numbered(
            edited, first - EDIT_CONTEXT_LINES, first + new.count("\n") + EDIT_CONTEXT_LINES
        )

    def write_file(self, path: str, content: str) -> str:
        """Replace the whole content of one existing file of the task.

        Args:
            path: the file name, e.g. "mathutil.py".
            content: the complete new text of the file.
        """
        self._editable(path).write_text(content)
        return f"wrote {len(content)} characters to {path}"

    def run_tests(self) -> str:
        """Run the task's tests with pytest and report the result."""
        passed, output = self.test()
        if passed:
            return f"{PASSED}: all tests pass, the task is done."
        return "FAILED\n" + _failure_lines(output)[-OUTPUT_TAIL_CHARS:]

    def test(self) -> tuple[bool, str]:
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "--tb=short",
            "--no-header",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:warnings",
            ".",
        ]
        # the examples' own pytest plugins (asyncio, hypothesis...) only add noise here
        env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        try:
            done = subprocess.run(
                command,
                cwd=self.root,
                capture_output=True,
                text=True,
                timeout=TEST_TIMEOUT_S,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return False, f"pytest ran past {TEST_TIMEOUT_S} s"
        return done.returncode == 0, done.stdout + done.stderr

    def tools(self) -> list[Tool]:
        functions = (
            self.list_files,
            self.read_file,
            self.replace_in_file,
            self.write_file,
            self.run_tests,
        )
        return [Tool.from_function(fn) for fn in functions]


def _numbered(text: str, first: int, last: int) -> str:
    """Lines first..last (1-based, clipped to the text) as `N| line`."""
    lines = text.splitlines()
    lo, hi = max(first, 1), min(last, len(lines))
    return "\n".join(f"{n}| {lines[n - 1]}" for n in range(lo, hi + 1))


def _call_text(call) -> str:
    """A call as text, to tell a repeat: its name and arguments (or its unparsed text)."""
    if not call.ok:
        return call.raw
    return f"{call.name}({json.dumps(call.arguments, sort_keys=True)})"


def _failure_lines(output: str) -> str:
    """pytest's output without the separator rules, progress dots, and the frames (with the
    source lines they quote) of pytest and the standard library: a task module that fails to
    import (a SyntaxError after an edit) otherwise leads with ~30 lines of importlib."""
    kept = []
    skip_quote = False
    for line in output.splitlines():
        stripped = line.strip()
        if not stripped or set(stripped) <= set("=_-!. ") or stripped.endswith("%]"):
            continue
        outside = ("site-packages", "/lib/python", "<frozen ")
        if line[:1] not in " E" and any(part in line for part in outside):
            skip_quote = True  # a frame outside the task: drop it and the source it quotes
            continue
        if skip_quote and line.startswith(" "):
            continue
        skip_quote = False
        kept.append(line)
    return "\n".join(kept)


async def _execute(tools: dict[str, Tool], call) -> tuple[str, bool]:
    """One call's (result, is_error); the model reads a failure as its result."""
    tool = tools.get(call.name)
    if not call.ok or tool is None:
        return f"error: cannot run {call.name!r}: {call.error or 'no such tool'}", True
    try:
        return await tool.invoke(call.arguments), False
    except Exception as exc:  # noqa: BLE001 - the model sees the tool's failure
        return f"error: {type(exc).__name__}: {exc}", True


def _print_turn(reply, results: list[tuple[str, bool]]) -> None:
    print(f"  [assistant] {reply.content.strip()!r} finish={reply.finish_reason}")
    for call, (content, is_error) in zip(reply.tool_calls, results, strict=True):
        shown = call.raw if not call.ok else f"{call.name}({call.arguments})"
        print(f"  [call] {shown}")
        print(f"  [{'error' if is_error else 'result'}] {content[:400]!r}")


async def run_task(
    engine, task: Path, max_turns: int, max_tokens: int, transcript: bool = False
) -> dict:
    workspace = TaskWorkspace(task)
    t0 = time.perf_counter()
    try:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        previous: list[str] = []  # the last turn's calls, as text
        repeats = 0
        files = ", ".join(sorted(p.name for p in task.glob("*.py")))
        ask = f"{(task / 'TASK.md').read_text().strip()}\nThe files: {files}."
        async with Session(engine, tools=workspace.tools(), system=SYSTEM, sampling=sampling) as s:
            reply = await s.send(ask, tool_choice=TOOL_CHOICE, parallel_tool_calls=False)
            turns = 1
            while reply.tool_calls:
                results = [await _execute(s.tools, call) for call in reply.tool_calls]
                if transcript:
                    _print_turn(reply, results)
                calls = [_call_text(call) for call in reply.tool_calls]
                repeated = calls == previous
                previous = calls
                for call, (content, is_error) in zip(reply.tool_calls, results, strict=True):
                    s.add_tool_result(
                        call.id, content + (REPEAT_NOTE if repeated else ""), is_error
                    )
                if any(content.startswith(PASSED) for content, _ in results) or turns >= max_turns:
                    break
                retry = None
                if repeated:  # greedy would write the same reply again
                    repeats += 1
                    retry = SamplingParams(
                        max_tokens=max_tokens, temperature=RETRY_TEMPERATURE, seed=turns
                    )
                reply = await s.send(
                    tool_choice=TOOL_CHOICE, parallel_tool_calls=False, sampling=retry
                )
                turns += 1
            if transcript and not reply.tool_calls:
                _print_turn(reply, [])
            usage = s.total_usage
        passed, _ = workspace.test()
    finally:
        workspace.close()
    return {
        "task": task.name,
        "passed": passed,
        "turns": turns,
        "prompt_tokens": usage.prompt_tokens,
        "computed_tokens": usage.computed_tokens,
        "output_tokens": usage.output_tokens,
        "repeated_calls": repeats,
        "seconds": round(time.perf_counter() - t0, 1),
        "last_reply": reply.content.strip()[:LAST_REPLY_CHARS],
    }


async def run_tasks(
    engine,
    tasks_dir: Path,
    names: list[str],
    max_turns: int,
    max_tokens: int,
    transcript: bool = False,
    json_path: Path | None = None,
) -> list[dict]:
    """Run every task folder under ``tasks_dir`` (or only ``names``) and print a summary."""
    tasks = sorted(p for p in tasks_dir.iterdir() if (p / "TASK.md").is_file())
    if names:
        tasks = [t for t in tasks if t.name in names]
    results = []
    for task in tasks:
        if transcript:
            print(f"== {task.name}", flush=True)
        result = await run_task(engine, task, max_turns, max_tokens, transcript)
        results.append(result)
        if json_path is not None:  # after every task: a long run's results survive a kill
            json_path.write_text(json.dumps(results, indent=1) + "\n")
        print(
            f"{result['task']:<20} {'PASS' if result['passed'] else 'fail'}  "
            f"turns={result['turns']} prompt_tokens={result['prompt_tokens']} "
            f"computed_tokens={result['computed_tokens']} "
            f"output_tokens={result['output_tokens']} {result['seconds']}s",
            flush=True,
        )
        if not result["passed"]:
            print(f"  last reply: {result['last_reply']!r}")
    num_passed = sum(r["passed"] for r in results)
    print(f"success rate: {num_passed}/{len(results)}")
    return results
