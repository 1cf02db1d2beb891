"""Models by short name: pulling joins the parts into the cache, checks the pins and removes
the parts; a name resolves to the pulled file, and a missing one is a ConfigError naming the
pull command. Fake parts (small packages in a temporary folder), no pip and no real model."""

import hashlib
from pathlib import Path

import pytest

from agentx import EngineConfig, model_store
from agentx.cli import main
from agentx.errors import ConfigError, ModelLoadError

SLICES = [b"GGUF" + bytes(range(200)), b"\x01" * 333, b"tail"]


def _entry(sha256: str | None = None) -> model_store.ModelEntry:
    data = b"".join(SLICES)
    parts = tuple(
        model_store.ModelPart(f"fake-part{i}==1.0", f"agentx_fake_part{i}", f"data/part{i:02d}.bin")
        for i in range(1, len(SLICES) + 1)
    )
    return model_store.ModelEntry(
        name="fake-model",
        file_name="fake-model.gguf",
        size_bytes=len(data),
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        parts=parts,
    )


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """An installer that 'installs' the parts as packages on sys.path and records its calls."""
    site = tmp_path / "site"
    monkeypatch.setenv("AGENTX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(site))
    calls: list[tuple[tuple[str, ...], bool]] = []

    def installer(requirements, install):
        calls.append((tuple(requirements), install))
        for i, data in enumerate(SLICES, start=1):
            folder = site / f"agentx_fake_part{i}"
            if install:
                (folder / "data").mkdir(parents=True)
                (folder / "__init__.py").write_text("")
                (folder / "data" / f"part{i:02d}.bin").write_bytes(data)

    return installer, calls


def test_pull_joins_checks_and_removes_the_parts(fake_parts):
    installer, calls = fake_parts
    entry = _entry()
    assert not model_store.is_present(entry)
    path = model_store.pull(entry, installer, progress=False)
    assert path == model_store.model_file(entry) and path.read_bytes() == b"".join(SLICES)
    assert path.parent == Path(model_store.env.cache_dir()) / "models"
    requirements = ("fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0")
    assert calls == [(requirements, True), (requirements, False)]
    assert model_store.is_present(entry)
    assert model_store.resolve("fake-model", {"fake-model": entry}) == path
    model_store.pull(entry, installer, progress=False)  # present: nothing installed again
    assert len(calls) == 2
    assert [p.name for p in path.parent.iterdir()] == ["fake-model.gguf"]  # no temporary left


def test_pull_rejects_a_wrong_sha256_and_leaves_nothing(fake_parts):
    installer, calls = fake_parts
    entry = _entry(sha256="0" * 64)
    with pytest.raises(ModelLoadError, match="sha256"):
        model_store.pull(entry, installer, progress=False)
    assert not model_store.model_file(entry).exists()
    assert list(model_store.model_file(entry).parent.iterdir()) == []
    assert [install for _, install in calls] == [True, False]  # parts removed all the same


def test_pull_names_a_missing_part(fake_parts):
    _, calls = fake_parts
    with pytest.raises(ModelLoadError, match="agentx_fake_part1"):
        model_store.pull(_entry(), lambda reqs, install: calls.append(install), progress=False)
    assert calls == [True, False]


def test_missing_model_is_a_config_error_naming_the_pull_command(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTX_CACHE_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="agentx models pull qwen2.5-coder-1.5b"):
        EngineConfig(model="qwen2.5-coder-1.5b")
    assert model_store.resolve("not-a-short-name") is None


def test_short_name_resolves_to_the_cached_file(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTX_CACHE_DIR", str(tmp_path))
    entry = model_store.MODELS["qwen2.5-coder-1.5b"]
    path = model_store.model_file(entry)
    path.parent.mkdir(parents=True)
    with path.open("wb") as file:  # a sparse stand-in of the pinned size
        file.truncate(entry.size_bytes)
    assert EngineConfig(model="qwen2.5-coder-1.5b").model_path == path


def test_models_list_shows_known_and_present(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AGENTX_CACHE_DIR", str(tmp_path))
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b" in out and "missing (agentx models pull qwen2.5-coder-1.5b)" in out
