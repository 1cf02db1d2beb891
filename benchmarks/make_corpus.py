"""Build ``agentx/bench/data/agent_corpus.txt``, the text that text-backed bench prompts are cut
from (agentx/bench/corpus.py). Run once; the file is committed and held by its sha256
(tests/bench/test_bench_prompts.py), so every machine replays the same text whatever its Python::

    python benchmarks/make_corpus.py     # with CPython 3.11.7 it rewrites the committed file

The text is of the kinds an agent's prompts carry, all from CPython's standard library (PSF
License, agentx/bench/data/LICENSE-PSF.txt) or generated from it with a seeded RNG:

- ``code``   whole functions and classes of a fixed list of stdlib modules, comments and all
- ``tool``   tool output: ``ls -l`` listings, pytest logs, unified diffs, tracebacks, grep hits
- ``prose``  module and function docstrings, and agent instructions around them

Documents are separated by ``\\x1e`` + kind + newline. Nothing here is imported by agentx.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import importlib.util
import random
import sys
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "agentx" / "bench" / "data" / "agent_corpus.txt"
MODULES = (
    "textwrap", "shlex", "fnmatch", "glob", "difflib", "argparse", "json.encoder",
    "json.decoder", "csv", "heapq", "bisect", "functools", "dataclasses", "string", "pathlib",
    "queue", "sched", "statistics", "tempfile", "contextlib", "enum", "shutil", "configparser",
    "logging", "typing", "inspect", "tokenize", "ast", "calendar", "gettext", "zipfile",
    "tarfile", "http.client", "urllib.parse", "email.message", "asyncio.tasks",
    "asyncio.queues", "concurrent.futures._base", "subprocess", "threading",
)  # fmt: skip
CODE_CHARS, TOOL_CHARS, PROSE_CHARS = 200_000, 140_000, 70_000
SEP = "\x1e"


def module_source(name: str) -> tuple[str, str]:
    spec = importlib.util.find_spec(name)
    path = Path(spec.origin)
    rel = str(path.relative_to(Path(textwrap.__file__).parent))
    return rel, path.read_text(encoding="utf-8")


def definitions(source: str) -> list[tuple[str, str, ast.AST]]:
    """(name, source text, node) of every top-level function and class."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            out.append((node.name, "".join(lines[start : node.end_lineno]), node))
    return out


def clean(text: str) -> str:
    return text.replace(SEP, " ").replace("<|", "< |")


def code_docs(mods: dict, rng: random.Random) -> list[str]:
    docs, size = [], 0
    per_module = CODE_CHARS // len(mods) + 1
    for rel, (_, defs) in mods.items():
        taken = 0
        for _, text, _ in defs:
            if len(text) > 6_000 or taken > per_module:
                continue
            docs.append(f"# {rel}\n{text}")
            taken += len(text)
        size += taken
    rng.shuffle(docs)
    return docs


def listing(rng: random.Random, mods: dict) -> str:
    names = sorted(rng.sample(sorted(mods), 12) + ["__init__.py", "conftest.py", "README.md"])
    rows = [f"total {rng.randrange(40, 400)}"]
    for name in names:
        day, hour, minute = rng.randrange(1, 29), rng.randrange(24), rng.randrange(60)
        size = rng.randrange(200, 90_000)
        rows.append(f"-rw-r--r-- 1 dev dev {size:>6} Nov {day:>2} {hour:02}:{minute:02} {name}")
    return "$ ls -l src/\n" + "\n".join(rows) + "\n"


def test_log(rng: random.Random, mods: dict) -> str:
    rel = rng.choice(sorted(mods))
    stem = Path(rel).stem
    funcs = [n for n, _, node in mods[rel][1] if not isinstance(node, ast.ClassDef)]
    funcs = rng.sample(funcs, min(len(funcs), rng.randrange(4, 14))) or ["module"]
    rows = [f"$ python -m pytest tests/test_{stem}.py -q", "=" * 20 + " test session starts " +
            "=" * 20, "platform linux -- Python 3.11.7, pytest-8.3.3, pluggy-1.5.0",
            f"collected {len(funcs)} items", ""]  # fmt: skip
    failed = []
    for i, name in enumerate(funcs):
        status = "FAILED" if rng.random() < 0.15 else "PASSED"
        if status == "FAILED":
            failed.append(name)
        pct = round(100 * (i + 1) / len(funcs))
        rows.append(f"tests/test_{stem}.py::test_{name} {status} [{pct:>3}%]")
    for name in failed:
        got, want = rng.randrange(100), rng.randrange(100)
        rows += ["", f"_____ test_{name} _____", f"    def test_{name}():",
                 f">       assert {name}(case) == expected",
                 f"E       AssertionError: assert {got} == {want}"]  # fmt: skip
    secs = rng.random() * 9
    rows.append(f"{len(failed)} failed, {len(funcs) - len(failed)} passed in {secs:.2f}s")
    return "\n".join(rows) + "\n"


def mutate(text: str, rng: random.Random) -> str:
    lines = text.splitlines(keepends=True)
    for _ in range(rng.randrange(1, 4)):
        i = rng.randrange(len(lines))
        line = lines[i]
        indent = line[: len(line) - len(line.lstrip())]
        choice = rng.randrange(3)
        if choice == 0:
            lines.insert(i, f"{indent}# TODO: handle the empty case before this\n")
        elif choice == 1 and "==" in line:
            lines[i] = line.replace("==", "!=", 1)
        else:
            lines[i] = line.rstrip("\n") + "  # checked\n"
    return "".join(lines)


def diff(rng: random.Random, mods: dict) -> str:
    rel = rng.choice(sorted(mods))
    candidates = [t for _, t, _ in mods[rel][1] if 200 < len(t) < 3_000]
    if not candidates:
        return ""
    text = rng.choice(candidates)
    body = difflib.unified_diff(text.splitlines(keepends=True),
                                mutate(text, rng).splitlines(keepends=True),
                                f"a/{rel}", f"b/{rel}")  # fmt: skip
    return f"$ git diff {rel}\n" + "".join(body)


def traceback_text(rng: random.Random, mods: dict) -> str:
    rows = ["Traceback (most recent call last):"]
    for _ in range(rng.randrange(2, 6)):
        rel = rng.choice(sorted(mods))
        source, defs = mods[rel]
        funcs = [(n, node) for n, _, node in defs if not isinstance(node, ast.ClassDef)]
        if not funcs:
            continue
        name, node = rng.choice(funcs)
        lineno = rng.randrange(node.lineno, node.end_lineno + 1)
        line = source.splitlines()[lineno - 1].strip() or "pass"
        rows += [f'  File "/usr/lib/python3.11/{rel}", line {lineno}, in {name}', f"    {line}"]
    error = rng.choice(["ValueError: invalid literal for int() with base 10: 'abc'",
                        "KeyError: 'session_id'", "TypeError: expected str, got NoneType",
                        "FileNotFoundError: [Errno 2] No such file or directory: 'out.json'",
                        "AttributeError: 'NoneType' object has no attribute 'split'"])  # fmt: skip
    return "$ python run.py\n" + "\n".join(rows + [error]) + "\n"


def grep(rng: random.Random, mods: dict) -> str:
    word = rng.choice(["return", "self", "raise", "import", "def ", "None", "len(", "for "])
    rows = []
    for rel in rng.sample(sorted(mods), 5):
        lines = mods[rel][0].splitlines()
        hits = [i for i, line in enumerate(lines) if word in line]
        for i in sorted(rng.sample(hits, min(len(hits), rng.randrange(2, 7)))):
            rows.append(f"{rel}:{i + 1}:{lines[i]}")
    return f"$ grep -rn {word.strip()!r} src/\n" + "\n".join(rows) + "\n"


def tool_docs(mods: dict, rng: random.Random) -> list[str]:
    makers = (listing, test_log, diff, diff, traceback_text, grep, test_log)
    docs, size = [], 0
    while size < TOOL_CHARS:
        doc = rng.choice(makers)(rng, mods)
        if doc:
            docs.append(doc)
            size += len(doc)
    return docs


INSTRUCTIONS = (
    "Read the failing test output above and fix the bug in {rel}. Keep the public API as it is "
    "and add a regression test next to the existing ones.",
    "Refactor `{name}` in {rel}: it has grown too long. Split it into smaller helpers, keep the "
    "behaviour identical and run the test suite before you answer.",
    "Explain what `{name}` in {rel} does, step by step, then list the edge cases it does not "
    "handle and how you would test each one.",
    "The user reports that `{name}` is slow on large inputs. Profile it, find the hot loop and "
    "propose a faster version with the same results.",
)


def prose_docs(mods: dict, rng: random.Random) -> list[str]:
    docs, size = [], 0
    for rel, (source, defs) in sorted(mods.items()):
        module_doc = ast.get_docstring(ast.parse(source)) or ""
        if module_doc:
            docs.append(f"## {rel}\n\n{module_doc}\n")
        for name, _, node in defs:
            doc = ast.get_docstring(node)
            if doc and len(doc) > 120:
                template = rng.choice(INSTRUCTIONS)
                docs.append(f"`{name}`: {doc}\n\n{template.format(rel=rel, name=name)}\n")
    rng.shuffle(docs)
    out = []
    for doc in docs:
        if size > PROSE_CHARS:
            break
        out.append(doc)
        size += len(doc)
    return out


def build() -> str:
    rng = random.Random("agentx-corpus-v1")
    mods = {}
    for name in MODULES:
        rel, source = module_source(name)
        mods[rel] = (source, definitions(source))
    parts = [("code", code_docs(mods, rng)), ("tool", tool_docs(mods, rng)),
             ("prose", prose_docs(mods, rng))]  # fmt: skip
    return "".join(f"{SEP}{kind}\n{clean(doc)}" for kind, docs in parts for doc in docs)


def main() -> None:
    text = build()
    OUT.write_text(text, encoding="utf-8")
    digest = hashlib.sha256(text.encode()).hexdigest()
    print(f"wrote {OUT}: {len(text)} chars, sha256 {digest} (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
