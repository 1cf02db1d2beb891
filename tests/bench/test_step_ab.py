"""benchmarks/step_ab.py: two engine configurations' decode steps in turn, in one process, each
round building the pair in the other order."""

import sys

import pytest

from agentx import CacheConfig, EngineConfig
from tests.helpers.scripts import load_script


@pytest.fixture
def step_ab(monkeypatch):
    return load_script(monkeypatch, "step_ab")


def test_settings_apply_to_the_config_and_its_cache(step_ab):
    base = EngineConfig(num_threads=2, cache=CacheConfig(kv_cache_bytes=1 << 30))
    config = step_ab.config_with(
        base, ["cache.huge_pages=true", "cache.block_size=64", "quantization=int8"]
    )
    assert config.cache.huge_pages is True
    assert config.cache.block_size == 64
    assert config.cache.kv_cache_bytes == 1 << 30  # the base's, kept
    assert config.quantization == "int8"
    assert config.num_threads == 2
    assert step_ab.config_with(base, []) == base
    assert base.cache.huge_pages is False  # the base itself untouched


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("cache.no_such_field=1", "CacheConfig has no field 'no_such_field'"),
        ("no_such_field=1", "EngineConfig has no field 'no_such_field'"),
        ("cache.huge_pages", "expected field=value"),
    ],
)
def test_a_setting_that_names_no_field_is_refused(step_ab, setting, message):
    with pytest.raises(ValueError, match=message):
        step_ab.config_with(EngineConfig(), [setting])


def test_two_rounds_build_the_pair_in_both_orders(step_ab, monkeypatch, capsys):
    argv = ["step_ab.py", "--decoders", "2", "--context", "40", "--steps", "3", "--rounds", "2"]
    argv += ["--threads", "1", "--b", "cache.block_size=32"]
    monkeypatch.setattr(sys, "argv", argv)
    step_ab.main()
    out = capsys.readouterr().out
    assert "2 round(s) of 3 steps each" in out
    assert "round 1 (built A then B)" in out
    assert "round 2 (built B then A)" in out
    assert "| A | (defaults) |" in out
    assert "| B | cache.block_size=32 |" in out
    assert "the rounds' paired medians averaged" in out


def test_an_engine_starts_with_every_request_decoding(step_ab):
    config = EngineConfig(
        num_threads=1,
        cache=CacheConfig(kv_cache_bytes=64 << 20),
    )
    prompts = [list(range(100, 140)), list(range(200, 260))]
    core = step_ab.start(config, prompts, "t", steps=5)
    try:
        running = {r.request_id: r for r in core.scheduler.running}
        assert set(running) == {"t-0", "t-1"}
        # prefilled, then the one decode step start() takes before the timed ones (and the
        # token the last prefill step sampled)
        assert [running[f"t-{i}"].num_output_tokens for i in range(2)] == [2, 2]
        # long enough to decode through the others' prefill (at most 100 steps) and 5 more
        assert all(r.sampling.max_tokens == 100 + 5 + 8 for r in running.values())
        core.check_integrity()
    finally:
        core.close()
