"""Bad input that needs no model: deeply nested tool-call output, trace files that are not
UTF-8, nested too deeply or hold absurd numbers, and the coding agent's tools given a symlink
out of their root."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from agentx.bench.loader import load_trace
from agentx.errors import TraceError
from agentx.session.tool_calls import ToolCallParser

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "body",
    [
        "[" * 5000,
        "[" * 5000 + "]" * 5000,
        '{"a": ' * 3000,
        '{"name": "f", "arguments": "' + "[" * 5000 + '"}',
    ],
)
def test_deeply_nested_tool_call_is_malformed_not_a_crash(body):
    text, calls = ToolCallParser(lambda: "call_0").parse(f"before <tool_call>{body}</tool_call>")
    assert text == "before "
    (call,) = calls
    assert call.id == "call_0" and call.error is not None and not call.ok


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_trace_that_is_not_utf8_is_a_trace_error(tmp_path, suffix):
    path = tmp_path / f"trace{suffix}"
    path.write_bytes(b'{"id": "\xff\xfe"}\n')
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(path)


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_trace_nested_too_deeply_is_a_trace_error(tmp_path, suffix):
    path = tmp_path / f"trace{suffix}"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(TraceError, match="nested too deeply"):
        load_trace(path)


@pytest.mark.parametrize("value", [1e300, 2**70, 1e15])
def test_a_trace_with_absurd_token_counts_is_a_trace_error(tmp_path, value):
    path = tmp_path / "trace.json"
    request = {"type": "s", "t": 0, "in": value, "out": 4, "hash_ids": [1]}
    session = {"id": "s", "requests": [request]}
    path.write_text(json.dumps(session))
    with pytest.raises(TraceError, match="'in'"):
        load_trace(path)


def test_mooncake_trace_with_absurd_numbers_is_a_trace_error(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"input_length": 1e300, "output_length": 1, "hash_ids": []}))
    with pytest.raises(TraceError, match="input_length"):
        load_trace(path)


@pytest.fixture(scope="module")
def coding_agent():
    spec = importlib.util.spec_from_file_location("coding_agent", ROOT / "examples/coding_agent.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["coding_agent"] = module
    sys.path.insert(0, str(ROOT / "examples"))  # it imports examples/_backend.py
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "examples"))
    yield module
    del sys.modules["coding_agent"]


def test_coding_agent_tools_never_follow_symlinks_out_of_the_root(coding_agent, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("TOKEN=hunter2\n")
    root = tmp_path / "root"
    (root / "src").mkdir(parents=True)
    (root / "src" / "main.py").write_text("TOKEN = read_env()\n")
    (root / "src" / "leak.txt").symlink_to(outside / "secret.txt")
    (root / "linked_dir").symlink_to(outside, target_is_directory=True)
    workspace = coding_agent.Workspace(root)
    matches = json.loads(workspace.grep("TOKEN"))
    assert matches == [{"path": "src/main.py", "line": 1, "text": "TOKEN = read_env()"}]
    assert json.loads(workspace.grep("TOKEN", "src")) == matches
    for path in ("src/leak.txt", "linked_dir/secret.txt", "../outside/secret.txt"):
        with pytest.raises(PermissionError):
            workspace.read_file(path)
        with pytest.raises(PermissionError):
            workspace.grep("TOKEN", path)
