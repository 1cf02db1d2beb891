"""A script of benchmarks/ imported as a module, for tests of its functions."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script(monkeypatch, name: str):
    """``benchmarks/<name>.py`` as the module ``name``: registered in ``sys.modules`` for the test
    (dataclasses look their module up there), with ``benchmarks/`` on ``sys.path`` (scripts import
    their neighbours)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module
