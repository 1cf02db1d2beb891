"""The P/D sweep (agentx/bench/pd_sweep.py, benchmarks/pd_sweep.py): the splits of N workers,
the best split at an interactivity floor, the predictions from a hand-made profile, the
command's errors, and one tiny run through the real coordinator and router."""

import json
from dataclasses import replace

import pytest

from agentx.bench.format_agentx import dump_agentx
from agentx.bench.metrics import RunMetrics
from agentx.bench.pd_model import RequestDemand, SaturationProfile, predict_pd
from agentx.bench.pd_sweep import (
    Prediction,
    best_line,
    best_split,
    enumerate_splits,
    predict_splits,
    table,
)
from agentx.bench.saturate import PROFILE_KIND
from agentx.bench.synth import SynthConfig, synthesize
from agentx.errors import ConfigError
from tests.helpers.scripts import load_script


def _script(monkeypatch):
    return load_script(monkeypatch, "pd_sweep")


# ---- splits ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_workers", "names"),
    [
        (2, ["colocated", "1P1D"]),
        (3, ["colocated", "1P2D", "2P1D"]),
        (4, ["colocated", "1P3D", "2P2D", "3P1D"]),
    ],
)
def test_splits_are_the_colocated_baseline_then_every_xpyd(num_workers, names):
    splits = enumerate_splits(num_workers)
    assert [s.name for s in splits] == names
    assert [(s.num_prefill, s.num_decode) for s in splits] == [
        (x, num_workers - x) for x in range(num_workers)
    ]
    assert [s.colocated for s in splits] == [True] + [False] * (num_workers - 1)
    assert {s.num_workers for s in splits} == {num_workers}


def test_one_worker_has_no_split():
    with pytest.raises(ConfigError, match="at least 2 workers, got 1"):
        enumerate_splits(1)


# ---- the best split ----------------------------------------------------------------------


def _metrics(engine: str, tpgs: float, p90: float | None, **kw) -> RunMetrics:
    base = RunMetrics(
        engine=engine, concurrency=8, wall_time=10.0, num_requests=10, num_failed=0,
        num_prompt_tokens=1000, num_output_tokens=100, tpgs=tpgs, output_tokens_per_s=10.0,
        ttft_p50=0.5, ttft_p90=1.25, interactivity_p50=20.0, interactivity_p90=p90,
        achieved_hit_rate=0.875, theoretical_hit_rate=0.9, num_cached_tokens=875,
        num_computed_prompt_tokens=125, num_recomputed_tokens=0, interrupted=False,
    )  # fmt: skip
    return replace(base, **kw)


def test_best_split_is_the_fastest_that_reaches_the_floor():
    rows = [
        _metrics("colocated", 500.0, 6.0),
        _metrics("1P3D", 900.0, 4.9),  # the fastest, below the floor
        _metrics("2P2D", 700.0, 5.0),  # at the floor exactly: it counts
        _metrics("3P1D", 800.0, 9.0, num_failed=1),  # a failure disqualifies
        _metrics("4P0D", 990.0, 9.0, interrupted=True),
        _metrics("none", 999.0, None),  # no request had two tokens
    ]
    assert best_split(rows, 5.0).engine == "2P2D"
    assert best_split(rows, 4.9).engine == "1P3D"  # at its floor: the fastest that counts
    assert best_split(rows, 6.0).engine == "colocated"
    assert best_line(rows, 6.0) == (
        "best split at interactivity P90 >= 6 tok/s: colocated (500 tok/s/worker, "
        "interactivity P90 6.0)"
    )


def test_best_split_none_meets_the_floor():
    rows = [_metrics("colocated", 500.0, 6.0), _metrics("1P1D", 700.0, 4.0)]
    assert best_split(rows, 6.5) is None
    assert best_split([], 0.0) is None
    assert best_line(rows, 6.5) == (
        "best split at interactivity P90 >= 6.5 tok/s: none reaches the floor"
    )


def test_best_split_ties_go_to_the_first():
    rows = [_metrics("colocated", 600.0, 7.0), _metrics("1P1D", 600.0, 8.0)]
    assert best_split(rows, 5.0).engine == "colocated"


# ---- predictions -------------------------------------------------------------------------


def _profile_json(engines=("agentx",)) -> dict:
    """Flat rates: prefill 100 computed tok/s at any length, decode 10 tok/s at any context."""
    part = {
        "prefill": [
            {"cached_fraction": 0.5, "prompt_tokens": 64, "computed_tokens_per_s": 100.0},
            {"cached_fraction": 0.5, "prompt_tokens": 4096, "computed_tokens_per_s": 100.0},
        ],
        "decode_at_floor": [
            {"context_tokens": 64, "batch": 4, "tokens_per_s": 10.0},
            {"context_tokens": 4096, "batch": 4, "tokens_per_s": 10.0},
        ],
    }
    return {
        "kind": PROFILE_KIND,
        "config": {"interactivity_floor": 5.0},
        "engines": {name: part for name in engines},
    }


def test_predictions_from_a_hand_made_profile():
    profile = SaturationProfile.from_json(_profile_json())
    # 100 computed tokens at 100 tok/s: P = 1 s; 40 output at 10 tok/s: D = 4 s; 240 tokens
    demand = [RequestDemand(200, 100, 40)]
    rows = predict_splits(profile, demand, enumerate_splits(3))
    assert rows == {
        "colocated": Prediction("colocated", 144.0, 48.0, None),  # 240 / ((1 + 4) / 3)
        "1P2D": Prediction("1P2D", 120.0, 40.0, "decode"),  # 240 / max(1 / 1, 4 / 2)
        "2P1D": Prediction("2P1D", 60.0, 20.0, "decode"),  # 240 / max(1 / 2, 4 / 1)
    }
    assert rows["1P2D"].tokens_per_s == predict_pd(profile, demand, 1, 2).tokens_per_s
    colocated = predict_pd(profile, demand, 2, 1).colocated_tokens_per_s
    assert rows["colocated"].tokens_per_s == colocated
    # prefill-bound: 1,000 computed tokens (P = 10 s), 10 output (D = 1 s), 1,210 tokens
    demand = [RequestDemand(1200, 200, 10)]
    rows = predict_splits(profile, demand, enumerate_splits(2))
    assert rows["1P1D"] == Prediction("1P1D", 121.0, 60.5, "prefill")
    assert rows["colocated"] == Prediction("colocated", 220.0, 110.0, None)


def test_table_rows_with_and_without_a_prediction():
    rows = [
        (_metrics("colocated", 96.0, 6.0), {"replicas": []}),
        (_metrics("1P1D", 33.0, 4.5), {"counters": {"num_handovers": 7, "num_local_prefills": 3}}),
    ]
    predictions = {"1P1D": Prediction("1P1D", 60.0, 30.0, "decode")}
    lines = table(rows, predictions).splitlines()
    assert len(lines) == 4 and lines[1] == "|---" * 12 + "|"
    assert lines[2] == (
        "| colocated | - | 96 | - | 0.50 | 1.25 | 20.0 | 6.0 | 87.5% | 0 | - | 10.0 |"
    )
    assert lines[3] == (
        "| 1P1D | 30 | 33 | 1.10 | 0.50 | 1.25 | 20.0 | 4.5 | 87.5% | 0 | 7 / 3 | 10.0 |"
    )


# ---- the command -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "1"], "at least 2 workers, got 1"),
        (["--splits", "3P1D"], "splits ['3P1D'] for 2 workers; choose from colocated, 1P1D"),
        (["--splits", ","], "unknown splits [] for 2 workers"),
        (["--interactivity-floor", "-1"], "--interactivity-floor must be >= 0, got -1.0"),
        (["--max-sessions", "0"], "--max-sessions must be positive, got 0"),
        (["--concurrency", "0"], "--concurrency must be positive, got 0"),
        (["--threads-per-worker", "0"], "--threads-per-worker must be positive, got 0"),
        (["--max-think", "-1"], "--max-think must be >= 0, got -1.0"),
        (["--profile", "/nonexistent/saturation.json"], "No such file or directory"),
    ],
)
def test_command_errors(monkeypatch, capsys, argv, message):
    script = _script(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        script.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_command_profile_errors(monkeypatch, capsys, tmp_path):
    script = _script(monkeypatch)
    not_a_profile = tmp_path / "results.json"
    not_a_profile.write_text(json.dumps({"kind": "agentx-bench-results"}))
    two = tmp_path / "two.json"
    two.write_text(json.dumps(_profile_json(("agentx", "vllm"))))
    cases = [
        ([str(not_a_profile)], "not a saturation profile: kind 'agentx-bench-results'"),
        ([str(two)], "the profile has engines ['agentx', 'vllm']: name one"),
        ([str(two), "--profile-engine", "llama"], "'llama'"),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit):
            script.parse_args(["--profile", *extra])
        assert message in capsys.readouterr().err
    args = script.parse_args(["--profile", str(two), "--profile-engine", "vllm", "--workers", "3",
                              "--splits", "2P1D,colocated"])  # fmt: skip
    assert [s.name for s in args.split_list] == ["colocated", "2P1D"]
    assert args.profile_obj.decode == ((64, 10.0), (4096, 10.0))


@pytest.mark.slow
def test_tiny_sweep_through_the_real_coordinator_and_router(monkeypatch, tmp_path, capsys):
    """1 session, 8 requests (6,228 prompt tokens, 54 output): colocated and 1P1D."""
    script = _script(monkeypatch)
    trace = tmp_path / "tiny.jsonl"
    dump_agentx(synthesize(SynthConfig(num_sessions=1, seed=1, scale=0.01,
                                       max_context_tokens=1024)), trace)  # fmt: skip
    profile = tmp_path / "saturation.json"
    profile.write_text(json.dumps(_profile_json()))
    out = tmp_path / "out"
    argv = [str(trace), "--max-think", "0", "--concurrency", "1", "--kv-cache-gib", "0.125",
            "--no-progress", "--profile", str(profile), "--out", str(out)]  # fmt: skip
    assert script.main(argv) == 0
    sweep = json.loads((out / "pd_sweep.json").read_text())
    assert [r["split"] for r in sweep["runs"]] == ["colocated", "1P1D"]
    for run in sweep["runs"]:
        m = run["metrics"]
        assert (m["num_requests"], m["num_failed"], m["num_output_tokens"]) == (8, 0, 54)
        assert m["achieved_hit_rate"] == m["theoretical_hit_rate"]  # nothing recomputed
        assert run["prediction"]["tokens_per_s_per_worker"] > 0
    counters = sweep["runs"][1]["engine_stats"]["counters"]
    assert counters["num_handovers"] + counters["num_local_prefills"] == 8
    assert counters["num_failed"] == 0
    best = script.best_split([RunMetrics(**r["metrics"]) for r in sweep["runs"]], 5.0)
    assert sweep["best"] == (best.engine if best else None)
    assert (out / "pd_sweep.png").stat().st_size > 0
    assert "| 1P1D |" in (out / "pd_sweep.md").read_text()
    assert "best split at interactivity P90 >= 5 tok/s" in capsys.readouterr().out


def test_parallel_flags_reach_every_worker(monkeypatch):
    script = _script(monkeypatch)
    options = script.worker_options(script.parse_args(["--tp", "2", "--ep", "1"]))
    assert options.parallel == {"tp": 2}
    assert options.router_options(3).parallel == {"tp": 2}
    assert script.worker_options(script.parse_args([])).parallel == {}
