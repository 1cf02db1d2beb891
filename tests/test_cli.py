"""The ``agentx`` command: help, version, ``python -m agentx``, the bench help, the serve
command's one-line start-up errors, and ``agentx chat`` fed from stdin."""

import re
import socket
import subprocess
import sys

import pytest


def run_agentx(*argv, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "agentx", *argv], capture_output=True, text=True, timeout=timeout
    )


def test_cli_help_version_and_usage():
    assert run_agentx("--help").returncode == 0
    version = run_agentx("--version")
    assert version.returncode == 0 and version.stdout.startswith("agentx ")
    bad = run_agentx("nope")
    assert bad.returncode == 2 and "usage: agentx" in bad.stderr
    bench = run_agentx("bench", "--help")
    assert bench.returncode == 0 and "``" not in bench.stdout and ":mod:" not in bench.stdout


def test_bench_options_all_have_help():
    import argparse

    from agentx.bench.cli import build_parser as bench_parser

    def walk(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from walk(sub)
            else:
                yield parser.prog, action

    missing = [(prog, a.dest) for prog, a in walk(bench_parser()) if not a.help]
    assert missing == []


def test_serve_fails_in_one_line_on_a_missing_model():
    result = run_agentx("serve", "--model", "/nonexistent/model.gguf", "--port", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "agentx serve: error: model file not found: /nonexistent/model.gguf"
    ]


def test_serve_fails_in_one_line_on_a_busy_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_agentx("serve", "--port", str(port))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"agentx serve: error: cannot listen on 127.0.0.1:{port}"
    )


@pytest.mark.parametrize("argv", [["chat", "--help"], ["serve", "--help"]])
def test_command_help(argv):
    result = run_agentx(*argv)
    assert result.returncode == 0 and "--model" in result.stdout


@pytest.mark.slow
def test_chat_streams_and_keeps_one_session_warm():
    turns = "Hi there.\nName a color.\n/exit\nnever read\n"
    result = subprocess.run(
        [sys.executable, "-m", "agentx", "chat", "--max-tokens", "8", "--temperature", "0"]
        + ["--stats"],
        input=turns,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    stats = re.findall(r"\[prompt (\d+), cached (\d+), output (\d+)\]", result.stdout)
    assert len(stats) == 2  # /exit ended it
    (prompt1, cached1, out1), (prompt2, cached2, _) = [tuple(map(int, s)) for s in stats]
    assert cached1 == 0
    assert cached2 == prompt1 + out1 - 1  # the held KV of turn 1: only the new message ran
