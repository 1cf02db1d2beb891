"""The import graph only points down (DESIGN.md), and the public surface is sorted."""

import ast
from pathlib import Path

import agentx

ROOT = Path(agentx.__file__).parent

# package prefix -> packages it must never import
FORBIDDEN = {
    "agentx.kernels": ["agentx.engine", "agentx.session", "agentx.openai", "agentx.bench"],
    "agentx.engine": ["agentx.session", "agentx.openai", "agentx.bench"],
    "agentx.session": ["agentx.openai", "agentx.bench"],
    "agentx.openai": ["agentx.bench"],
    "agentx.engine.kv_cache": [
        "agentx.engine.scheduler",
        "agentx.engine.runner",
        "agentx.engine.models",
        "agentx.engine.core",
        "agentx.engine.client",
    ],
    "agentx.engine.scheduler": [
        "agentx.engine.runner",
        "agentx.engine.models",
        "agentx.engine.core",
        "agentx.engine.client",
    ],
    "agentx.engine.models": [
        "agentx.engine.runner",
        "agentx.engine.scheduler",
        "agentx.engine.kv_cache",
        "agentx.engine.core",
        "agentx.engine.client",
    ],
    "agentx.engine.runner": [
        "agentx.engine.scheduler",
        "agentx.engine.core",
        "agentx.engine.client",
    ],
    "agentx.engine.offload": [
        "agentx.engine.scheduler",
        "agentx.engine.runner",
        "agentx.engine.models",
        "agentx.engine.core",
        "agentx.engine.client",
    ],
    "agentx.engine.core": ["agentx.engine.client"],
    # the models take a ParallelState: it sits below them (the executors sit above the runner)
    "agentx.engine.parallel.state": [
        "agentx.engine.models",
        "agentx.engine.runner",
        "agentx.engine.core",
        "agentx.engine.client",
    ],
    "agentx.engine.parallel.prefill_split": [
        "agentx.engine.models",
        "agentx.engine.runner",
        "agentx.engine.core",
        "agentx.engine.client",
    ],
    # the vLLM backend sits beside agentx's engine: it shares records, never the engine itself
    "agentx.engine.vllm": [
        "agentx.engine.client",
        "agentx.engine.core",
        "agentx.engine.scheduler",
        "agentx.engine.runner",
        "agentx.engine.kv_cache",
        "agentx.engine.offload",
    ],
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_nothing_imports_upward():
    violations = []
    for path in ROOT.rglob("*.py"):
        mod = module_name(path)
        for prefix, banned in FORBIDDEN.items():
            if not under(mod, prefix):
                continue
            for imported in imports_of(path):
                if any(under(imported, b) for b in banned):
                    violations.append(f"{mod} imports {imported}")
    assert violations == []


def test_public_all_is_sorted_and_exported():
    assert agentx.__all__ == sorted(agentx.__all__)
    for name in agentx.__all__:
        assert hasattr(agentx, name), name


def test_error_tree_is_documented():
    from agentx import errors

    for name in errors.__all__:
        assert name in errors.__doc__, f"{name} missing from the errors docstring"
        assert issubclass(getattr(errors, name), errors.AgentXError)
