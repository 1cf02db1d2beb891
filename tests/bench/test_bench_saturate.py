"""``agentx bench saturate``: buckets from a trace, probe arithmetic, the P/D prediction on a
hand-made profile, CLI errors, and one end-to-end run on the fake engine."""

import asyncio
import json

import pytest

from agentx.bench.cli import bench_main
from agentx.bench.fake_adapter import FakeAdapter
from agentx.bench.format_agentx import dump_agentx
from agentx.bench.pd_model import (
    RequestDemand,
    SaturationProfile,
    interpolate,
    predict_pd,
    trace_demand,
)
from agentx.bench.prompts import PromptBuilder
from agentx.bench.saturate import (
    PROFILE_KIND,
    Prober,
    SaturateConfig,
    at_floor,
    cached_prefix_tokens,
    derive_buckets,
    steady_tokens_per_s,
)
from agentx.bench.trace import SessionTrace, Trace, TraceRequest
from agentx.errors import ConfigError


def _request(num_input: int, num_output: int, hash_ids) -> TraceRequest:
    return TraceRequest(0.0, num_input, num_output, tuple(hash_ids))


def small_trace() -> Trace:
    # a: 128, 256, 512 tokens, each extending the last (hits 0, 128, 256); b: 1000 tokens
    # starting with a's first two blocks (hits 128)
    a = SessionTrace(
        "a",
        (_request(128, 10, (1, 2)), _request(256, 10, range(1, 5)), _request(512, 20, range(1, 9))),
    )
    b = SessionTrace("b", (_request(1000, 40, (1, 2, *range(100, 114))),))
    return Trace("small", 64, (a, b))


def test_buckets_are_the_traces_quantiles_in_whole_blocks():
    buckets = derive_buckets(small_trace(), SaturateConfig())
    # prompts 128 256 512 1000: quantiles 166.4, 384, 853.6 -> whole blocks
    assert buckets.prompt_tokens == (192, 384, 896)
    # cached fractions 0, .5, .5, .128: quantiles .0384, .314, .5 -> hundredths, rounded down
    assert buckets.cached_fractions == (0.03, 0.31, 0.5)
    # contexts 138 266 532 1040: 176.4, 399, 887.6
    assert buckets.context_tokens == (192, 448, 896)
    # uncached 128 128 256 872: 128, 192, 687.2
    assert buckets.new_tokens == (128, 192, 688)


def test_buckets_fit_the_context_and_drop_duplicates():
    config = SaturateConfig(quantiles=(0.5, 0.9, 1.0), max_context=800, decode_tokens=100)
    buckets = derive_buckets(small_trace(), config)
    assert buckets.prompt_tokens == (384, 768)  # 799 -> 768 in whole blocks; 896, 1000 clipped
    assert buckets.context_tokens == (448, 640)  # 700 -> 640
    with pytest.raises(ConfigError, match="has no requests"):
        derive_buckets(Trace("empty", 64, ()), config)


def test_cached_prefix_is_whole_blocks_and_leaves_a_token_to_compute():
    assert cached_prefix_tokens(1000, 0.5, 64) == 448
    assert cached_prefix_tokens(1000, 0.0, 64) == 0
    assert cached_prefix_tokens(1024, 1.0, 64) == 960
    assert cached_prefix_tokens(100, 0.9, 64) == 64


def test_steady_rate_and_best_batch_at_the_floor():
    # two requests: all decode between 1.0 (the last first token) and 2.0 (the first last one)
    times = [[0.5, 1.0, 1.5, 2.0], [1.0, 1.25, 1.5, 1.75, 2.0, 2.5]]
    assert steady_tokens_per_s(times) == (2 + 4) / 1.0
    # no overlap: every token after each first one, over 0 .. 3
    assert steady_tokens_per_s([[0.0, 1.0], [2.0, 3.0]]) == 2 / 3.0
    assert steady_tokens_per_s([]) == 0.0
    decode = [
        {"context_tokens": 512, "batch": 1, "tokens_per_s": 10.0, "interactivity_p90": 10.0},
        {"context_tokens": 512, "batch": 4, "tokens_per_s": 30.0, "interactivity_p90": 7.5},
        {"context_tokens": 512, "batch": 16, "tokens_per_s": 64.0, "interactivity_p90": 4.0},
        {"context_tokens": 2048, "batch": 1, "tokens_per_s": 4.0, "interactivity_p90": 4.0},
        {"context_tokens": 2048, "batch": 4, "tokens_per_s": 9.0, "interactivity_p90": None},
    ]
    assert at_floor(decode, 5.0) == [
        {"context_tokens": 512, "batch": 4, "tokens_per_s": 30.0},
        {"context_tokens": 2048, "batch": None, "tokens_per_s": None},
    ]


def hand_profile() -> dict:
    prefill = [
        (1000, 0.0, 1000.0),
        (2000, 0.0, 500.0),
        (1000, 0.5, 2000.0),
        (3000, 0.5, 1000.0),
    ]
    return {
        "kind": PROFILE_KIND,
        "version": 1,
        "config": {"interactivity_floor": 5.0},
        "engines": {
            "x": {
                "prefill": [
                    {"prompt_tokens": n, "cached_fraction": f, "computed_tokens_per_s": r}
                    for n, f, r in prefill
                ],
                "decode_at_floor": [
                    {"context_tokens": 1075, "batch": 8, "tokens_per_s": 100.0},
                    {"context_tokens": 3075, "batch": 4, "tokens_per_s": 50.0},
                    {"context_tokens": 6000, "batch": None, "tokens_per_s": None},
                ],
            }
        },
    }


def test_profile_loads_rows_and_interpolates():
    profile = SaturationProfile.from_json(hand_profile())
    assert profile.prefill == {
        0.0: ((1000, 1000.0), (2000, 500.0)),
        0.5: ((1000, 2000.0), (3000, 1000.0)),
    }
    assert profile.decode == ((1075, 100.0), (3075, 50.0))  # no batch reached the floor at 6000
    assert profile.get_prefill_rate(1500, 0.1) == 750.0
    assert profile.get_prefill_rate(1500, 0.25) == 750.0  # a tie: the lower cached fraction
    assert profile.get_prefill_rate(500, 0.9) == 2000.0  # flat before the first point
    assert profile.get_decode_rate(2075) == 75.0
    assert profile.get_decode_rate(9000) == 50.0
    assert interpolate([(0, 1.0), (10, 3.0)], 5) == 2.0
    with pytest.raises(ValueError, match="not a saturation profile"):
        SaturationProfile.from_json({"kind": "results"})
    two = hand_profile()
    two["engines"]["y"] = two["engines"]["x"]
    with pytest.raises(ValueError, match=r"engines \['x', 'y'\]: name one"):
        SaturationProfile.from_json(two)
    assert SaturationProfile.from_json(two, "y") == profile


def test_pd_prediction_on_a_hand_made_profile():
    profile = SaturationProfile.from_json(hand_profile())
    demand = [
        RequestDemand(2000, 0, 150),  # prefill 2000 / 500 = 4 s; decode at 2075: 150 / 75 = 2 s
        RequestDemand(3000, 1500, 150),  # 1500 / 1000 = 1.5 s; at 3075: 150 / 50 = 3 s
        RequestDemand(4000, 3000, 50),  # row 0.5, flat: 1000 / 1000 = 1 s; 50 / 50 = 1 s
        RequestDemand(1000, 250, 0),  # row 0.0 (tie): 750 / 1000 = 0.75 s; no decode
    ]
    tokens = 2150 + 3150 + 4050 + 1000
    p = predict_pd(profile, demand, 1, 1)
    assert (p.prefill_busy_s, p.decode_busy_s, p.num_tokens) == (7.25, 6.0, tokens)
    assert p.tokens_per_s == tokens / 7.25 and p.bottleneck == "prefill"
    assert p.colocated_tokens_per_s == tokens / (13.25 / 2)
    assert p.tokens_per_s_per_instance == tokens / 7.25 / 2
    p = predict_pd(profile, demand, 2, 1)
    assert p.tokens_per_s == 1725.0 and p.bottleneck == "decode"  # max(3.625, 6.0)
    assert p.colocated_tokens_per_s == tokens / (13.25 / 3)
    assert p.speedup == 1725.0 / (tokens / (13.25 / 3))
    with pytest.raises(ValueError, match="at least one instance of each kind, got 0P1D"):
        predict_pd(profile, demand, 0, 1)


def test_trace_demand_uses_the_theoretical_hits():
    assert trace_demand(small_trace()) == [
        RequestDemand(128, 0, 10),
        RequestDemand(256, 128, 10),
        RequestDemand(512, 256, 20),
        RequestDemand(1000, 128, 40),
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batches", "0"], "argument --batches: values must be >= 1, got '0'"),
        (["--quantiles", "0.5,1.5"], "argument --quantiles: values must be [0, 1]"),
        (["--contexts", "a,b"], "argument --contexts: not a list of int: 'a,b'"),
        (["--decode-tokens", "1"], "decode_tokens must be >= 2, got 1"),
        (["--max-requests", "0"], "max_requests must be positive, got 0"),
    ],
)
def test_saturate_argument_errors(tmp_path, capsys, flags, message):
    trace = tmp_path / "t.jsonl"
    dump_agentx(small_trace(), trace)
    with pytest.raises(SystemExit) as exc:
        bench_main(["saturate", str(trace), "--out", str(tmp_path / "o"), *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_saturate_requires_a_trace_and_an_out_folder(capsys):
    with pytest.raises(SystemExit):
        bench_main(["saturate", "--out", "x"])
    assert "the following arguments are required: trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main(["saturate", "t.jsonl"])
    assert "the following arguments are required: --out" in capsys.readouterr().err


def test_saturate_end_to_end_on_the_fake_adapter(tmp_path):
    trace = tmp_path / "t.jsonl"
    dump_agentx(small_trace(), trace)
    out = tmp_path / "sat"
    argv = ["saturate", str(trace), "--out", str(out), "--engines", "fake", "--batches",
            "1,3", "--decode-tokens", "4", "--prefill-tokens", "1024", "--quantiles",
            "0.5,0.9"]  # fmt: skip
    assert bench_main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "saturation.json",
        "saturation.md",
        "saturation.png",
    ]
    obj = json.loads((out / "saturation.json").read_text())
    assert obj["buckets"] == {
        "prompt_tokens": [384, 896],
        "cached_fractions": [0.31, 0.5],
        "context_tokens": [448, 896],
        "new_tokens": [192, 688],
    }
    part = obj["engines"]["fake"]
    # (prompt, cached, requests): whole blocks cached; enough requests for 1024 new tokens
    probes = [(p["prompt_tokens"], p["cached_tokens"], p["num_requests"]) for p in part["prefill"]]
    assert probes == [(384, 64, 4), (384, 192, 6), (896, 256, 2), (896, 448, 3)]
    # the fake engine's exact prefix cache served every probe request its warmed prefix
    assert [p["num_cached_reported"] for p in part["prefill"]] == [256, 1152, 512, 1344]
    assert [(d["context_tokens"], d["batch"]) for d in part["decode"]] == [
        (448, 1), (448, 3), (896, 1), (896, 3),
    ]  # fmt: skip
    assert all(d["tokens_per_s"] > 0 and d["interactivity_p90"] > 0 for d in part["decode"])
    assert [a["context_tokens"] for a in part["decode_at_floor"]] == [448, 896]
    profile = SaturationProfile.from_json(obj)
    assert sorted(profile.prefill) == [0.31, 0.5]
    assert [c for c, _ in profile.decode] == [448, 896]
    assert predict_pd(profile, trace_demand(small_trace()), 1, 1).num_tokens == 1976
    text = (out / "saturation.md").read_text()
    assert text.startswith("# agentx bench saturate: t\n")
    assert "| 896 | 50% | 448 (50%) | 3 |" in text


@pytest.mark.parametrize(("distinct", "num_cached"), [(False, 3 * 192), (True, 0)])
def test_decode_probe_shares_all_but_the_last_block_unless_distinct(distinct, num_cached):
    config = SaturateConfig(decode_tokens=3, distinct_contexts=distinct)
    engine = FakeAdapter()
    prober = Prober(engine, PromptBuilder(64), config)
    row = asyncio.run(prober.decode(3, 256))
    assert (row["batch"], row["context_tokens"]) == (3, 256)
    assert row["num_cached_reported"] == num_cached
    # one request warms the shared 192 tokens, then the batch of 3
    starts = [rid for event, rid, _ in engine.log if event == "start"]
    assert len(starts) == (3 if distinct else 4)
