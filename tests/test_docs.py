"""The docs stay navigable and current (STYLE principle 17).

Every relative link in README.md and docs/ (docs/bench/ included) names a file of the repository,
and an anchor names a heading of its file; docs/BENCHMARKS.md holds the current results only, at
most 400 lines, with history in dated files under docs/bench/.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
MAX_BENCHMARKS_LINES = 400


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*$", text, flags=re.M)}


def _links(path: Path) -> list[str]:
    return [a or b for a, b in LINK.findall(_prose(path.read_text()))]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_relative_links_resolve_inside_the_repository(doc: Path) -> None:
    broken = []
    for target in _links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.is_relative_to(ROOT) or not dest.exists():
            broken.append(f"{target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_docs_are_found() -> None:
    names = {d.relative_to(ROOT).as_posix() for d in DOCS}
    assert {"README.md", "docs/BENCHMARKS.md", "docs/DESIGN.md"} <= names


def test_benchmarks_holds_current_results_only() -> None:
    lines = (ROOT / "docs" / "BENCHMARKS.md").read_text().splitlines()
    assert len(lines) <= MAX_BENCHMARKS_LINES, f"docs/BENCHMARKS.md has {len(lines)} lines"
    assert any(line.startswith("## History") for line in lines)


def test_reliability_names_tests_that_exist() -> None:
    """Every ``file::test`` docs/RELIABILITY.md cites is a test function of that file, and
    every file it lists as a sweep exists."""
    text = (ROOT / "docs" / "RELIABILITY.md").read_text()
    cited = re.findall(r"`([\w/]+\.py)::(\w+)`", text)
    assert len(cited) > 30
    missing = []
    for path, name in cited:
        source = ROOT / "tests" / path
        pattern = rf"^(async )?def {name}\(|^{name} = "
        if not source.exists() or not re.search(pattern, source.read_text(), flags=re.M):
            missing.append(f"{path}::{name}")
    sweeps = re.findall(r"^\| `([\w/]+\.py)`", text, flags=re.M)
    missing += [path for path in sweeps if not (ROOT / "tests" / path).exists()]
    assert not missing, f"docs/RELIABILITY.md cites what does not exist: {missing}"
