"""The tools of ``coding_agent.py --tasks`` (``examples/_coding_tasks.py``), without a model:
what each returns or refuses on a copy of a real task, and that the copy is fixed by one edit."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import _coding_tasks  # noqa: E402

TASK = ROOT / "examples" / "coding_tasks" / "02_is_even"
# the fixed line 3 and the two lines above it (the file has no lines below)
EDITED = (
    '1| def is_even(n: int) -> bool:\n2|     """Whether n is even."""\n3|     return n % 2 == 0'
)


@pytest.fixture
def workspace():
    ws = _coding_tasks.TaskWorkspace(TASK)
    yield ws
    ws.close()
    assert not ws.root.exists()


def test_tools_read_refuse_and_fix(workspace):
    assert [t.name for t in workspace.tools()] == [
        "list_files",
        "read_file",
        "replace_in_file",
        "write_file",
        "run_tests",
    ]
    assert workspace.list_files() == "TASK.md\nparity.py\ntest_parity.py"
    assert "return n % 2 == 1\n" in workspace.read_file("parity.py")
    with pytest.raises(ValueError, match="'nope.py' does not exist"):
        workspace.read_file("nope.py")
    with pytest.raises(ValueError, match="outside the task folder"):
        workspace.read_file("../01_sum_range/mathutil.py")
    with pytest.raises(ValueError, match="is a test"):
        workspace.replace_in_file("test_parity.py", "is_even(4)", "is_even(5)")
    with pytest.raises(ValueError, match="is a test"):
        workspace.write_file("test_parity.py", "")
    with pytest.raises(ValueError, match="nothing would change"):
        workspace.replace_in_file("parity.py", "== 1", "== 1")
    with pytest.raises(ValueError, match="does not occur"):
        workspace.replace_in_file("parity.py", "n % 3", "n % 2")
    with pytest.raises(ValueError, match=r"occurs 2 times in parity.py \(lines 1, 2\)"):
        workspace.replace_in_file("parity.py", "even", "odd")

    failed = workspace.run_tests()
    assert failed.startswith("FAILED\n")
    assert "E   assert False" in failed and "%]" not in failed
    assert workspace.read_file("TASK.md") == (TASK / "TASK.md").read_text()  # untouched

    assert workspace.replace_in_file("parity.py", "== 1", "== 0") == (
        "replaced 1 occurrence in parity.py; now:\n" + EDITED
    )
    assert workspace.run_tests() == "PASSED: all tests pass, the task is done."
    assert "== 1" in (TASK / "parity.py").read_text()  # the task folder stays broken


def test_a_repeated_call_is_told_apart_by_name_and_arguments():
    class Call:
        def __init__(self, name, arguments, ok=True, raw=""):
            self.name, self.arguments, self.ok, self.raw = name, arguments, ok, raw

    text = _coding_tasks._call_text
    a = Call("replace_in_file", {"path": "p.py", "old": "x", "new": "y"})
    same = Call("replace_in_file", {"new": "y", "old": "x", "path": "p.py"})  # key order aside
    other = Call("replace_in_file", {"path": "p.py", "old": "x", "new": "z"})
    assert text(a) == text(same) != text(other)
    assert text(Call("", {}, ok=False, raw='<tool_call>{"name": }')) == '<tool_call>{"name": }'


def test_an_edit_that_breaks_the_import_reports_the_error_not_importlib(workspace):
    workspace.replace_in_file("parity.py", "    return", "  return")
    failed = workspace.run_tests()
    assert "IndentationError" in failed and "parity.py" in failed
    assert "importlib" not in failed and "site-packages" not in failed
