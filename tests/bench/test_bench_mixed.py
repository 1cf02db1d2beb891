"""The mixed trace of the lanes benchmark: exact sessions, prompt lengths, hits and arrivals."""

import asyncio
import importlib.util
from pathlib import Path

import pytest

from agentx.bench.adapter import EngineInfo
from agentx.bench.fake_adapter import FakeAdapter
from agentx.bench.mixed import COLD, WARM, WARM_UP, MixedConfig, mixed_trace, request_kind
from agentx.bench.records import RequestRecord, RunResult
from agentx.bench.replay import Replay, ReplayConfig
from agentx.bench.trace_stats import theoretical_hits
from agentx.errors import ConfigError


def test_default_mixed_trace_has_exact_sessions_lengths_and_arrivals():
    config = MixedConfig()
    trace = mixed_trace(config)
    assert [s.session_id for s in trace.sessions] == [
        "warm-0", "warm-1", "warm-2", "warm-3", "cold-0", "cold-1", "cold-2",
    ]  # fmt: skip
    assert trace.num_requests == 4 * 11 + 3
    warm = trace.sessions[0].steps
    # 1024 system + 64 task, then 16 output + 112 tool result per turn
    assert [r.num_input_tokens for r in warm] == [1088 + 128 * k for k in range(11)]
    assert [r.num_output_tokens for r in warm] == [16] * 11
    assert [r.think_time for r in warm] == [0.0] + [1.0] * 10
    cold = [s.steps for s in trace.sessions[4:]]
    assert [len(steps) for steps in cold] == [1, 1, 1]
    assert [(r.num_input_tokens, r.num_output_tokens, r.think_time) for (r,) in cold] == [
        (6144, 8, 8.0),
        (6144, 8, 18.0),
        (6144, 8, 28.0),
    ]
    assert config.max_think == 28.0
    assert config.num_warm_context_tokens == 1088 + 128 * 10 + 16
    for _, request in trace.iter_requests():
        assert len(request.hash_ids) == -(-request.num_input_tokens // 64)


def test_warm_sessions_share_the_system_prompt_and_cold_turns_share_nothing():
    trace = mixed_trace(MixedConfig())
    firsts = [s.steps[0].hash_ids for s in trace.sessions[:4]]
    assert len({ids[:16] for ids in firsts}) == 1  # 1024 system tokens: 16 shared blocks
    assert len({ids[16] for ids in firsts}) == 4  # a private task each
    hits = theoretical_hits(trace)
    per_warm = [0, *(1088 + 128 * (k - 1) for k in range(1, 11))]
    # warm-0's warm-up is cold; later warm-ups hit the system prompt; a warm turn computes 128
    assert hits[:11] == per_warm
    assert hits[11:44] == ([1024] + per_warm[1:]) * 3
    assert hits[44:] == [0, 0, 0]
    requests = [r for _, r in trace.iter_requests()]
    assert [r.num_input_tokens - h for r, h in zip(requests, hits, strict=True)][1:11] == [128] * 10


def test_request_kinds_of_a_replay():
    config = MixedConfig(
        num_warm_sessions=2, warm_turns=2, num_cold_sessions=1, cold_tokens=256,
        warm_think_time=0.0, cold_delay=0.0, system_tokens=128,
    )  # fmt: skip
    trace = mixed_trace(config)
    replay = Replay(trace, FakeAdapter(), ReplayConfig(3, config.max_think, progress=False))
    result = asyncio.run(replay.run(None))
    kinds = sorted((r.request_id, request_kind(r)) for r in result.records)
    assert kinds == [
        ("cold-0#0", COLD),
        ("warm-0#0", WARM_UP), ("warm-0#1", WARM), ("warm-0#2", WARM),
        ("warm-1#0", WARM_UP), ("warm-1#1", WARM), ("warm-1#2", WARM),
    ]  # fmt: skip


def test_mixed_config_errors_and_context_check():
    MixedConfig().check_fits(8192)
    with pytest.raises(ConfigError, match="needs 6152 tokens of context, the model has 6000"):
        MixedConfig().check_fits(6000)
    with pytest.raises(ConfigError, match="warm_output_tokens must be >= 2"):
        MixedConfig(warm_output_tokens=1)
    with pytest.raises(ConfigError, match="cold_tokens must be positive"):
        MixedConfig(cold_tokens=0)


def _lanes_bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "lanes_bench.py"
    spec = importlib.util.spec_from_file_location("lanes_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(request_id: str, submit: float, times: tuple[float, ...]) -> RequestRecord:
    session = request_id.split("#")[0]
    return RequestRecord(request_id, session, session, 100, len(times), 0, 0, submit, times,
                         times[-1])  # fmt: skip


def test_lanes_bench_summary_splits_warm_turns_from_warm_ups_and_cold_turns():
    records = (
        _record("warm-0#0", 0.0, (1.0, 2.0)),  # a warm-up: in neither group
        _record("warm-0#1", 3.0, (3.5, 4.0, 4.5)),  # TTFT 0.5, 2 tok/s
        _record("warm-0#2", 5.0, (7.0, 7.25)),  # TTFT 2.0, 4 tok/s
        _record("warm-1#1", 3.0, (4.0, 5.0)),  # TTFT 1.0, 1 tok/s
        _record("cold-0#0", 2.0, (10.0, 11.0)),  # TTFT 8.0
    )
    result = RunResult(EngineInfo("agentx", "0"), 3, 11.0, records)
    row = _lanes_bench().summarize(result)
    assert row["num_warm_turns"] == 3 and row["num_cold_turns"] == 1
    assert row["warm_ttft_p50"] == 1.0 and row["warm_ttft_p90"] == pytest.approx(1.8)
    assert row["warm_interactivity_p50"] == 2.0
    assert row["warm_interactivity_p90"] == pytest.approx(1.2)  # the 10th percentile
    assert row["cold_ttft_p50"] == row["cold_ttft_max"] == 8.0
    assert row["tpgs"] == (5 * 100 + 11) / 11.0 and row["num_failed"] == 0
