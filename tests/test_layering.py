"""The import graph only points down (DESIGN.md), has no cycle between modules or packages,
and the public surface is sorted."""

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    "agentx.engine.parallel": [
        "agentx.engine.models",
        "agentx.engine.runner",
        "agentx.engine.executors",
        "agentx.engine.core",
        "agentx.engine.client",
    ],
    "agentx.engine.executors": ["agentx.engine.core", "agentx.engine.client"],
    # the vLLM backend sits beside agentx's engine: it shares records, never the engine itself
    "agentx.engine.vllm": [
        "agentx.engine.client",
        "agentx.engine.core",
        "agentx.engine.scheduler",
        "agentx.engine.runner",
        "agentx.engine.kv_cache",
        "agentx.engine.offload",
        "agentx.engine.executors",
    ],
}

# leaf modules: records two layers share; they import nothing of agentx's but these
LEAVES = {
    "agentx.engine.block_hash": set(),
    "agentx.errors": set(),
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


def test_leaf_modules_import_nothing_of_agentx():
    for leaf, allowed in LEAVES.items():
        path = ROOT.parent / (leaf.replace(".", "/") + ".py")
        imported = {name for name in imports_of(path) if under(name, "agentx")}
        assert imported <= allowed, f"{leaf} imports {imported - allowed}"


# ---- cycles ------------------------------------------------------------------------------------
#
# At run time ``import a.b.c`` first runs ``a/b/__init__.py``: a module that imports ``a.b.c``
# depends on package ``a.b`` too (unless the importer sits inside ``a.b``, whose __init__ has
# then already started). Only imports that run when the module is imported count: module-level
# ones, not those inside functions or under ``if TYPE_CHECKING``.

MODULES = {module_name(path): path for path in ROOT.rglob("*.py")}


def ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def executed_imports(path: Path) -> Iterator[str]:
    """The agentx modules and packages importing ``path`` runs (``from P import x``: P and, when
    x is a submodule, P.x)."""
    stack = list(ast.parse(path.read_text()).body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.If):
            test = node.test
            type_checking = getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING"
            stack += ([] if type_checking else node.body) + node.orelse
        elif isinstance(node, ast.Try):
            stack += node.body + node.orelse + node.finalbody
            stack += [stmt for handler in node.handlers for stmt in handler.body]
        elif isinstance(node, ast.With):
            stack += node.body


def module_graph() -> dict[str, set[str]]:
    """module or package -> the modules and packages importing it runs first."""
    graph = {}
    for mod, path in MODULES.items():
        deps = set()
        for name in executed_imports(path):
            if name in MODULES:
                deps |= {n for n in {name} | ancestors(name) if n != mod} - ancestors(mod)
        graph[mod] = deps
    return graph


def package_of(mod: str) -> str:
    return mod if MODULES[mod].name == "__init__.py" else mod.rpartition(".")[0]


def package_graph() -> dict[str, set[str]]:
    """package -> the packages its modules import, nesting left out (a package's modules may
    import their parent's leaf modules, and the parent's modules their subpackages)."""
    graph: dict[str, set[str]] = {}
    for mod, deps in module_graph().items():
        pkg = package_of(mod)
        edges = graph.setdefault(pkg, set())
        for dep in deps:
            other = package_of(dep)
            if other != pkg and other not in ancestors(pkg) and pkg not in ancestors(other):
                edges.add(other)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e", "d"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    assert cycles(module_graph()) == []


def test_no_import_cycle_between_packages():
    graph = package_graph()
    assert "agentx.engine.kv_cache" in graph and "agentx.engine.runner" in graph
    assert cycles(graph) == []


_IMPORT_EACH = """
import importlib, sys
import agentx
bad = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m.startswith("agentx.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:  # an optional dependency (vllm, mooncake, fastapi)
        if (exc.name or "agentx").startswith("agentx"):
            bad.append(f"{name}: {exc!r}")
    except Exception as exc:
        bad.append(f"{name}: {exc!r}")
print(*bad, sep=chr(10))
"""


@pytest.mark.slow  # ~190 fresh imports: a minute or more on 2 cores
def test_every_module_imports_on_its_own():
    """Each module imported first (every other agentx module unloaded before it), so an import
    order that a cycle depends on cannot hide it."""
    names = sorted(name for name in MODULES if not name.endswith("__main__"))
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent), "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, *names],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == ""
