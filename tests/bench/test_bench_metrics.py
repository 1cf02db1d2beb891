"""Metrics math on hand-made timestamps; results JSON, Markdown and plots."""

import json
from dataclasses import replace

import pytest

from agentx.bench.adapter import EngineInfo
from agentx.bench.metrics import draft_acceptance, percentile, run_metrics, tpgs_at_floor
from agentx.bench.records import RequestRecord, RunResult
from agentx.bench.report import markdown
from agentx.bench.results import Results, cpu_model_from, make_header


def rec(rid, prompt, times, submit=0.0, cached=None, theo=0, error=None):
    return RequestRecord(
        request_id=rid,
        session_id="s",
        agent_id="s",
        num_prompt_tokens=prompt,
        num_output_tokens=len(times),
        num_cached_tokens=cached,
        theoretical_hit_tokens=theo,
        submit_time=submit,
        token_times=tuple(times),
        end_time=times[-1] if times else submit,
        error=error,
    )


def run(records, engine="agentx", concurrency=2, wall=10.0):
    return RunResult(EngineInfo(engine, "1"), concurrency, wall, tuple(records))


def test_percentile_interpolates():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.9) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.1) == pytest.approx(1.4)


def test_run_metrics_exact():
    records = [
        # TTFT 1.0; 4 tokens over 1.5 s after the first: 2 tok/s
        rec("a", 100, [1.0, 1.5, 2.0, 2.5], submit=0.0, cached=60, theo=64),
        # TTFT 0.5; 2 tokens after the first in 0.5 s: 4 tok/s
        rec("b", 200, [3.5, 3.75, 4.0], submit=3.0, cached=192, theo=128),
        # one token: a TTFT, no interactivity
        rec("c", 50, [6.0], submit=4.0, cached=0, theo=0),
        rec("d", 999, [7.0], submit=5.0, cached=0, theo=0, error="X: failed"),
    ]
    m = run_metrics(run(records, wall=8.0))
    assert (m.num_requests, m.num_failed) == (3, 1)
    assert (m.num_prompt_tokens, m.num_output_tokens) == (350, 8)
    assert m.tpgs == (350 + 8) / 8.0
    assert m.output_tokens_per_s == 1.0
    assert m.ttft_p50 == 1.0
    assert m.ttft_p90 == pytest.approx(1.8)  # [0.5, 1.0, 2.0] at 0.9
    assert m.interactivity_p50 == 3.0  # [2, 4]
    assert m.interactivity_p90 == pytest.approx(2.2)  # the 10th percentile: the slow tail
    assert m.num_cached_tokens == 252
    assert m.achieved_hit_rate == 252 / 350
    assert m.theoretical_hit_rate == 192 / 350
    assert m.num_computed_prompt_tokens == 98
    assert m.num_recomputed_tokens == 4  # a: 64 - 60; b cached more than the trace saw
    assert not m.interrupted


def test_unreported_cache_and_devices():
    result = RunResult(EngineInfo("peer", "1"), 1, 2.0, (rec("a", 10, [1.0, 2.0]),), num_devices=2)
    m = run_metrics(result)
    assert m.achieved_hit_rate is None and m.num_recomputed_tokens is None
    assert m.tpgs == 12 / 2.0 / 2


def test_draft_acceptance_from_engine_counters():
    assert draft_acceptance(None) is None
    assert draft_acceptance({"num_draft_tokens": 0, "num_accepted_tokens": 0}) is None
    assert draft_acceptance({"num_draft_tokens": 40, "num_accepted_tokens": 30}) == 0.75
    replicas = {"replicas": [{"num_draft_tokens": 10, "num_accepted_tokens": 1}, {}]}
    assert draft_acceptance(replicas) == 0.1
    result = replace(
        run([rec("a", 10, [1.0, 2.0])]),
        engine_stats={"num_draft_tokens": 8, "num_accepted_tokens": 2},
    )
    m = run_metrics(result)
    assert m.draft_acceptance == 0.25
    header = make_header({"id": "t", "stats": {}}, {"floor": 1.0})
    assert "| 25.0% |" in markdown(Results(header, (result,)), 1.0)


def test_tpgs_at_floor():
    slow = run([rec("a", 100, [1.0, 2.0, 3.0])], concurrency=8, wall=4.0)  # 1 tok/s
    fast = run([rec("a", 10, [1.0, 1.1, 1.2])], concurrency=1, wall=2.0)  # 10 tok/s
    metrics = [run_metrics(slow), run_metrics(fast)]
    assert tpgs_at_floor(metrics, 5.0) == 13 / 2.0
    assert tpgs_at_floor(metrics, 0.5) == 103 / 4.0
    assert tpgs_at_floor(metrics, 50.0) is None


def test_results_roundtrip_report_and_plots(tmp_path):
    runs = (
        run([rec("a", 100, [1.0, 1.5, 2.0], cached=50, theo=64)], "agentx", 2, 4.0),
        run([rec("a", 100, [1.0, 2.0, 3.0], cached=0, theo=64)], "peer", 2, 8.0),
    )
    header = make_header({"id": "t", "stats": {"num_sessions": 1}}, {"floor": 1.0})
    results = Results(header, runs)
    path = tmp_path / "results.json"
    results.write(path, floor=1.0)
    obj = json.loads(path.read_text())
    assert obj["kind"] == "agentx-bench-results" and obj["machine"]["cores"] >= 1
    assert obj["versions"]["torch"] and obj["versions"]["python"]
    assert obj["runs"][0]["metrics"]["tpgs"] == 103 / 4.0
    assert obj["summary"]["ratios"]["peer"] == {"2": (103 / 8.0) / (103 / 4.0)}
    assert obj["summary"]["tpgs_at_floor"] == {"agentx": 103 / 4.0, "peer": 103 / 8.0}
    again = Results.read(path)
    assert again.runs == runs
    text = markdown(again, 1.0)
    assert (
        "| agentx | 2 | 1 | 0 | 4.0 | 26 | 0.8 | 1.00 | 1.00 | 2.0 | 2.0 | 50.0% | 64.0% | 14 | - |"
        in text
    )
    assert "- peer: c=2: 0.50x" in text
    from agentx.bench.plots import plot_all

    paths = plot_all(again, tmp_path / "plots")
    assert sorted(p.name for p in paths) == [
        "hit_rate.png",
        "interactivity_vs_tpgs.png",
        "tpgs_vs_concurrency.png",
        "ttft_cdf.png",
    ]
    assert all(p.stat().st_size > 1000 for p in paths)


ZEN2_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 49
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx f16c fma avx2 bmi2

processor\t: 1
model name\t: Some Other Name
flags\t\t: avx512f
"""


def test_cpu_model_names_family_model_and_the_kernel_isa():
    # a VM's "AMD EPYC" alone does not say Zen 2 from Zen 5: the record carries both numbers
    assert cpu_model_from(ZEN2_CPUINFO) == "AMD EPYC (family 23 model 49; avx2)"
    xeon = ZEN2_CPUINFO.replace("AMD EPYC", "Intel(R) Xeon(R) Platinum 8480+").replace(
        "fma avx2 bmi2", "avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_int8"
    )
    assert cpu_model_from(xeon) == (
        "Intel(R) Xeon(R) Platinum 8480+ (family 23 model 49; "
        "avx2, avx512f, avx512_vnni, avx512_bf16, amx_tile)"
    )
    assert cpu_model_from(ZEN2_CPUINFO.replace(" avx2", "")) == (
        "AMD EPYC (family 23 model 49; no avx2)"
    )
    assert cpu_model_from("processor\t: 0\n") == ""


def test_report_puts_each_wall_time_beside_the_think_bound():
    runs = (
        run([rec("a", 100, [1.0, 1.5, 2.0])], "agentx", 2, 4.0),
        run([rec("a", 100, [1.0, 2.0, 3.0])], "peer", 2, 8.0),
        run([rec("a", 100, [1.0, 2.0, 3.0])], "peer", 4, 5.0),
    )
    stats = {"num_prompt_tokens": 300, "num_output_tokens": 30}
    trace = {"id": "t", "stats": stats, "think_bound_s": {"2": 3.0, "4": 2.5}}
    text = markdown(Results(make_header(trace, {"floor": 1.0}), runs), 1.0)
    assert "no time): c=2: 3.0 s (TPGS <= 110), c=4: 2.5 s (TPGS <= 132)." in text
    assert "- agentx: c=2: 75%\n- peer: c=2: 38%, c=4: 50%\n" in text
    no_think = {**trace, "think_bound_s": {"2": 0.0, "4": 0.0}}
    assert "Think-time bound" not in markdown(Results(make_header(no_think, {}), runs), 1.0)
