"""``coding_agent.py --tasks``: fix-the-bug tasks, each run through one Session with tools.

A task is a folder (``examples/coding_tasks/NN_name/``) holding a tiny Python module with one
bug, a failing pytest test and ``TASK.md`` (what is wrong). Each task runs in a temporary copy,
so the folders stay broken for the next run. The agent gets four tools over that copy:

- ``list_files()``: the files of the task,
- ``read_file(path)``: one file's text,
- ``write_file(path, content)``: replace one file (only files that exist, inside the copy),
- ``run_tests()``: ``pytest -q`` in the copy (a subprocess), its exit status and output tail.

The Session loop (``Session.run``) calls tools until the model answers without one or the turn
limit is reached; then the tests run once more and decide success. Printed per task: success,
turns, output and computed (prefilled) tokens; at the end the success rate.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentx import SamplingParams, Session, Tool

SYSTEM = (
    "You are a careful Python developer. Fix the bug described by the user. Read the code "
    "with read_file, replace the buggy file with write_file (its whole new content), then "
    "call run_tests. Stop when the tests pass."
)
TEST_TIMEOUT_S = 60
OUTPUT_TAIL_CHARS = 1500
LAST_REPLY_CHARS = 300  # of a failed task's last reply, on screen


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

    def list_files(self) -> str:
        """List the files of the task."""
        return "\n".join(sorted(p.name for p in self.root.iterdir() if p.is_file()))

    def read_file(self, path: str) -> str:
        """Read one file of the task.

        Args:
            path: the file name, e.g. "mathutil.py".
        """
        return self._path(path).read_text()

    def write_file(self, path: str, content: str) -> str:
        """Replace the whole content of one existing file of the task.

        Args:
            path: the file name, e.g. "mathutil.py".
            content: the complete new text of the file.
        """
        target = self._path(path)
        if not target.is_file():
            raise ValueError(f"{path!r} does not exist; only existing files can be written")
        target.write_text(content)
        return f"wrote {len(content)} characters to {path}"

    def run_tests(self) -> str:
        """Run the task's tests with pytest and report the result."""
        passed, output = self.test()
        return ("PASSED" if passed else "FAILED") + "\n" + output[-OUTPUT_TAIL_CHARS:]

    def test(self) -> tuple[bool, str]:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "."]
        try:
            done = subprocess.run(
                command, cwd=self.root, capture_output=True, text=True, timeout=TEST_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return False, f"pytest ran past {TEST_TIMEOUT_S} s"
        return done.returncode == 0, done.stdout + done.stderr

    def tools(self) -> list[Tool]:
        functions = (self.list_files, self.read_file, self.write_file, self.run_tests)
        return [Tool.from_function(fn) for fn in functions]


async def run_task(engine, task: Path, max_turns: int, max_tokens: int) -> dict:
    workspace = TaskWorkspace(task)
    t0 = time.perf_counter()
    try:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        source = [p.name for p in task.glob("*.py") if not p.name.startswith("test_")]
        ask = (
            f"{(task / 'TASK.md').read_text().strip()} The code is in {', '.join(source)}; "
            "the tests are in the test_*.py file."
        )
        async with Session(engine, tools=workspace.tools(), system=SYSTEM, sampling=sampling) as s:
            reply = await s.run(ask, max_turns=max_turns, tool_choice="auto")
            usage = s.total_usage
            turns = sum(1 for m in s.messages if m.role == "assistant")
        passed, _ = workspace.test()
    finally:
        workspace.close()
    return {
        "task": task.name,
        "passed": passed,
        "turns": turns,
        "output_tokens": usage.output_tokens,
        "computed_tokens": usage.computed_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
        "last_reply": reply.content.strip()[:LAST_REPLY_CHARS],
    }


async def run_tasks(engine, tasks_dir: Path, names: list[str], max_turns: int, max_tokens: int):
    """Run every task folder under ``tasks_dir`` (or only ``names``) and print a summary."""
    tasks = sorted(p for p in tasks_dir.iterdir() if (p / "TASK.md").is_file())
    if names:
        tasks = [t for t in tasks if t.name in names]
    results = []
    for task in tasks:
        result = await run_task(engine, task, max_turns, max_tokens)
        results.append(result)
        print(
            f"{result['task']:<20} {'PASS' if result['passed'] else 'fail'}  "
            f"turns={result['turns']} output_tokens={result['output_tokens']} "
            f"computed_tokens={result['computed_tokens']} {result['seconds']}s",
            flush=True,
        )
        if not result["passed"]:
            print(f"  last reply: {result['last_reply']!r}")
    num_passed = sum(r["passed"] for r in results)
    print(f"success rate: {num_passed}/{len(results)}")
    return results
