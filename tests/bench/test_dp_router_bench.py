"""The DP router bench (benchmarks/dp_router_bench.py): its table, and one tiny replay in which a
session moves to the idle replica, held KV and all, while its tool runs."""

import json
from dataclasses import replace

import pytest

from agentx.bench.format_agentx import dump_agentx
from agentx.bench.metrics import RunMetrics
from agentx.bench.trace import SessionTrace, Trace, TraceRequest
from tests.helpers.scripts import load_script


def _script(monkeypatch):
    return load_script(monkeypatch, "dp_router_bench")


def test_table_has_the_tool_wait_columns(monkeypatch):
    script = _script(monkeypatch)
    metrics = RunMetrics(
        engine="sticky-migrate-toolwait", concurrency=8, wall_time=10.0, num_requests=10,
        num_failed=0, num_prompt_tokens=1000, num_output_tokens=100, tpgs=110.0,
        output_tokens_per_s=10.0, ttft_p50=0.5, ttft_p90=1.25, interactivity_p50=20.0,
        interactivity_p90=9.0, achieved_hit_rate=0.875, theoretical_hit_rate=0.9,
        num_cached_tokens=875, num_computed_prompt_tokens=125, num_recomputed_tokens=64,
        interrupted=False,
    )  # fmt: skip
    stats = {
        "requests_per_replica": [6, 4],
        "num_migrations": 3,
        "num_tool_wait_migrations": 2,
        "migrated_held_tokens": 384,
        "ttft_after_migration": [0.25, 0.75],
        "num_tier_loaded_blocks": 5,
    }
    unmoved = {**stats, "num_migrations": 0, "num_tool_wait_migrations": 0,
               "migrated_held_tokens": 0, "ttft_after_migration": [None, None]}  # fmt: skip
    lines = script.table([(metrics, stats), (replace(metrics, engine="sticky"), unmoved)])
    lines = lines.splitlines()
    assert lines[1] == "|---" * 17 + "|"
    assert lines[2] == (
        "| sticky-migrate-toolwait | 10 | 0 | 87.5% | 90.0% | 64 | 110 | 0.50 | 1.25 | 9.0 | "
        "6 / 4 | 3 | 2 | 384 | 0.25 / 0.75 | 5 | 10.0 |"
    )
    assert lines[3] == (
        "| sticky | 10 | 0 | 87.5% | 90.0% | 64 | 110 | 0.50 | 1.25 | 9.0 | "
        "6 / 4 | 0 | 0 | 0 | - / - | 5 | 10.0 |"
    )


def _tiny_trace() -> Trace:
    """s1: a short turn, a 1.5 s tool, a turn extending it. s2: one long turn sharing s1's first
    two blocks (its prefix), so the router sends it beside s1 and s1's home is the busier
    replica when s1's first turn ends."""
    s1 = SessionTrace("s1", (
        TraceRequest(0.0, 128, 8, (1, 2)),
        TraceRequest(1.6, 200, 4, (1, 2, 3, 4), think_time=1.5),
    ))  # fmt: skip
    s2 = SessionTrace("s2", (TraceRequest(0.0, 192, 96, (1, 2, 5)),))
    return Trace("tiny-toolwait", 64, (s1, s2))


@pytest.mark.slow
def test_a_session_moves_during_its_tool_wait_end_to_end(monkeypatch, tmp_path):
    script = _script(monkeypatch)
    trace = tmp_path / "tiny.jsonl"
    dump_agentx(_tiny_trace(), trace)
    out = tmp_path / "dp.json"
    argv = [str(trace), "--policies", "sticky-migrate-toolwait", "--migrate-after", "0",
            "--concurrency", "2", "--max-think", "2", "--kv-cache-gib", "0.125",
            "--no-progress", "--json", str(out)]  # fmt: skip
    assert script.main(argv) == 0  # final_stats ran the router's check_integrity
    [run] = json.loads(out.read_text())["runs"]
    m, stats = run["metrics"], run["engine_stats"]
    assert run["loop"] == "closed"
    assert (m["num_requests"], m["num_failed"]) == (3, 0)
    # s1's first turn computed 128 + 8 - 1 tokens: its 8 full blocks moved to the idle replica
    assert stats["migrations"] == [{"session_id": "s1", "source": 0, "target": 1,
                                    "num_held_tokens": 128, "during_tool_wait": True}]  # fmt: skip
    assert (stats["num_tool_wait_migrations"], stats["migrated_held_tokens"]) == (1, 128)
    assert stats["after_migration"] == ["s1#1"]
    assert stats["requests_per_replica"] == [2, 1]
    assert stats["replicas"][1]["num_cached_tokens"] == 128  # the next turn found them there
    p50, p90 = stats["ttft_after_migration"]
    assert p50 == p90 > 0  # one turn after a migration
