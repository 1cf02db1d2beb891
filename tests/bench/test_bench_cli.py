"""The CLI end to end on the fake engines: synth, run, compare, plot."""

import json
import sys

import pytest

from agentx.bench.cli import bench_main, main
from agentx.bench.format_agentx import load_agentx
from agentx.bench.sweep import SweepPoint, plan


def test_synth_writes_a_trace_and_prints_the_hit_rate(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert bench_main(["synth", "-o", str(out), "--sessions", "8"]) == 0
    err = capsys.readouterr().err
    assert "synth-s0-n8-x0.05-o0.25: 8 sessions, 99 requests" in err
    assert "median output 111 tokens" in err  # --output-scale 0.25: decode that weighs
    assert "theoretical prefix hit rate 89.46% (491264 of 549119 prompt tokens" in err
    trace = load_agentx(out)
    assert len(trace.sessions) == 8 and trace.block_size == 64


def test_loop_follows_the_trace_kind(tmp_path):
    from agentx.bench.cli import replay_loop
    from agentx.bench.format_agentx import dump_agentx
    from agentx.bench.synth import SynthConfig, synthesize

    trace = synthesize(SynthConfig(num_sessions=2, scale=0.01, max_context_tokens=1024))
    dump_agentx(trace, tmp_path / "t.jsonl")
    assert load_agentx(tmp_path / "t.jsonl").meta["synth"]["scale"] == 0.01
    recorded = tmp_path / "r.jsonl"  # a trace without the synth config: recorded
    recorded.write_text((tmp_path / "t.jsonl").read_text().replace('"synth"', '"other"'))
    assert load_agentx(recorded).meta == {}
    assert replay_loop("auto", "text", synthesized=True) == "closed"
    assert replay_loop("auto", "text", synthesized=False) == "open"
    assert replay_loop("auto", "random", synthesized=True) == "open"
    assert replay_loop("closed", "random", synthesized=False) == "closed"


def test_plan_alternates_engines():
    assert plan(["a", "b"], [1, 2, 4]) == [
        SweepPoint("a", 1),
        SweepPoint("b", 1),
        SweepPoint("b", 2),
        SweepPoint("a", 2),
        SweepPoint("a", 4),
        SweepPoint("b", 4),
    ]


def test_run_compare_and_plot(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    bench_main(["synth", "-o", str(trace), "--sessions", "3", "--scale", "0.01"])
    out = tmp_path / "res"
    common = ["--max-think", "0", "--no-progress", "--out", str(out), "--concurrency", "1,3"]
    random_ids = ["--prompts", "random"]  # exact lengths: the achieved hit rate is exact too
    assert bench_main(["run", str(trace), "--engine", "fake", *random_ids, *common]) == 0
    obj = json.loads((out / "results.json").read_text())
    assert [(r["engine"]["engine"], r["concurrency"]) for r in obj["runs"]] == [
        ("fake", 1),
        ("fake", 3),
    ]
    m = obj["runs"][0]["metrics"]
    assert (
        m["achieved_hit_rate"]
        == m["theoretical_hit_rate"]
        == obj["trace"]["stats"]["theoretical_hit_rate"]
    )
    assert obj["config"]["token_space"] == {"low": 17, "high": 49152}
    assert obj["trace"]["think_bound_s"] == {"1": 0.0, "3": 0.0}  # --max-think 0
    assert sorted(p.name for p in out.iterdir()) == [
        "hit_rate.png",
        "interactivity_vs_tpgs.png",
        "results.json",
        "results.md",
        "tpgs_vs_concurrency.png",
        "ttft_cdf.png",
    ]
    worker = f"fw={sys.executable} -m agentx.bench.fake_worker --decode-s 0.0005"
    out2 = tmp_path / "cmp"
    common[common.index(str(out))] = str(out2)
    common[-1] = "2"  # one concurrency: one worker start (plan() is tested above)
    assert bench_main(["compare", str(trace), "--engines", f"fake,{worker}", *common]) == 0
    obj = json.loads((out2 / "results.json").read_text())
    order = [(r["engine"]["engine"], r["concurrency"]) for r in obj["runs"]]
    assert order == [("fake", 2), ("fw", 2)]
    # a trace file that synth wrote: text prompts, closed loop (over the worker protocol too)
    assert (obj["config"]["prompts"], obj["config"]["loop"]) == ("text", "closed")
    assert all(r["metrics"]["num_failed"] == 0 for r in obj["runs"])
    assert set(obj["summary"]["ratios"]) == {"fake", "fw"} and obj["summary"]["ratios_vs"] == "fake"
    text = capsys.readouterr().out
    assert "TPGS ratio vs fake" in text
    (out2 / "results.md").unlink()
    assert bench_main(["plot", str(out2 / "results.json")]) == 0
    assert (out2 / "results.md").read_text().startswith("# agentx bench: t")


def test_console_script_and_bad_engine(tmp_path, capsys):
    assert main(["nope"]) == 2
    trace = tmp_path / "t.jsonl"
    assert main(["bench", "synth", "-o", str(trace), "--sessions", "1", "--scale", "0.01"]) == 0
    with pytest.raises(ValueError, match="unknown engine 'nosuch'"):
        bench_main(["run", str(trace), "--engine", "nosuch", "--out", str(tmp_path / "o")])


def test_peer_engine_resolution(tmp_path, monkeypatch):
    from agentx.bench.engines import EngineSettings, _worker_argv

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AGENTX_PEERS_DIR", str(tmp_path / "peers"))
    (tmp_path / "benchmarks" / "peers").mkdir(parents=True)
    (tmp_path / "benchmarks" / "peers" / "worker_hf.py").write_text("")
    settings = EngineSettings("/m.gguf", 2)
    # no peer venv, no converted model: this Python and the shared model
    assert _worker_argv("hf", "", settings) == [
        sys.executable, "benchmarks/peers/worker_hf.py", "--model", "/m.gguf", "--threads", "2",
    ]  # fmt: skip
    (tmp_path / "peers" / "hf" / "bin").mkdir(parents=True)
    (tmp_path / "peers" / "hf" / "bin" / "python").write_text("")
    (tmp_path / "peers" / "models" / "SmolLM2-135M-Instruct.Q4_1-hf").mkdir(parents=True)
    assert _worker_argv("hf", "", settings)[::3] == [
        str(tmp_path / "peers" / "hf" / "bin" / "python"),
        str(tmp_path / "peers" / "models" / "SmolLM2-135M-Instruct.Q4_1-hf"),
    ]
    # an agentx variant given as a command line loads agentx's model, not the peers' export
    assert _worker_argv("agentx-nospec", "w.py --speculative off", settings)[4:6] == [
        "--model", "/m.gguf",
    ]  # fmt: skip
    mine = EngineSettings("/m.gguf", 2, peer_models={"hf": "/hf"}, default_model=False)
    assert _worker_argv("hf", "", mine)[3] == "/hf"
    assert _worker_argv("x", "w.py --model /own --fast", mine) == [
        sys.executable, "w.py", "--model", "/own", "--fast", "--threads", "2",
    ]  # fmt: skip
    assert _worker_argv("agentx", "", mine)[1:] == [
        "-m", "agentx.bench.worker", "--dtype", "float32", "--kv-cache-gib", "2.0",
        "--max-num-batched-tokens", "2048", "--model", "/m.gguf", "--threads", "2",
    ]  # fmt: skip


def test_vllm_ngram_peer_carries_the_speculative_config(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    from agentx.bench.engines import EngineSettings, _worker_argv

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("AGENTX_PEERS_DIR", str(tmp_path / "peers"))
    argv = _worker_argv("vllm-ngram", "", EngineSettings("/m.gguf", 2))
    assert argv[1:] == [
        "benchmarks/peers/worker_vllm.py", "--speculative", "ngram",
        "--num-speculative-tokens", "8", "--prompt-lookup-max", "4", "--prompt-lookup-min", "2",
        "--model", "/m.gguf", "--threads", "2",
    ]  # fmt: skip
    # the peer's own argument parsing turns the flags into vLLM's speculative_config
    monkeypatch.syspath_prepend(str(repo / "benchmarks" / "peers"))
    spec = importlib.util.spec_from_file_location(
        "worker_vllm", repo / "benchmarks" / "peers" / "worker_vllm.py"
    )
    worker_vllm = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "worker_vllm", worker_vllm)  # its dataclasses look it up
    spec.loader.exec_module(worker_vllm)
    monkeypatch.setattr(sys, "argv", ["worker_vllm.py", *argv[2:]])
    kwargs = worker_vllm.engine_kwargs(worker_vllm.parse_args())
    assert kwargs["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 8,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    monkeypatch.setattr(sys, "argv", ["worker_vllm.py", "--model", "/m", "--threads", "1"])
    assert "speculative_config" not in worker_vllm.engine_kwargs(worker_vllm.parse_args())


def test_parallel_degrees_reach_the_agentx_engines(tmp_path):
    from agentx.bench.cli import build_parser, make_engines
    from agentx.bench.engines import EngineSettings, _worker_argv

    settings = EngineSettings("/m.gguf", 2, parallel={"tp": 2, "dcp": 2})
    argv = _worker_argv("agentx", "", settings)
    assert argv[argv.index("--dcp") : argv.index("--dcp") + 4] == ["--dcp", "2", "--tp", "2"]
    trace = str(tmp_path / "t.jsonl")
    args = build_parser().parse_args(
        ["saturate", trace, "--out", str(tmp_path), "--engines", "fake", "--tp", "2", "--ep", "1"]
    )
    _, settings, _ = make_engines(args, ["fake"])
    assert settings.parallel == {"tp": 2}
    args = build_parser().parse_args(["run", "--engine", "agentx-inproc", "--dp", "2"])
    factories, settings, _ = make_engines(args, ["agentx-inproc"])
    engine = factories["agentx-inproc"]()  # not started: no model is loaded
    assert engine.options.engine_config().parallel.dp == 2


def test_resolve_model_takes_the_store_short_names(monkeypatch):
    from pathlib import Path

    from agentx import model_store
    from agentx.bench.engines import resolve_model

    def resolve(name):
        return Path("/cache/coder.gguf") if name == "coder" else None

    monkeypatch.setattr(model_store, "resolve", resolve)
    assert resolve_model("coder") == "/cache/coder.gguf"
    assert resolve_model("/models/x.gguf") == "/models/x.gguf"
