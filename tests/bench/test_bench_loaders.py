"""Trace loaders: the AgentX (weka) JSON format and Mooncake JSONL, valid and invalid input."""

import json

import pytest

from agentx.bench.format_agentx import dump_agentx, load_agentx
from agentx.bench.format_mooncake import load_mooncake
from agentx.bench.loader import load_trace
from agentx.bench.trace import SessionTrace, Subagent, Trace, TraceRequest, group_steps
from agentx.bench.trace_stats import theoretical_hits, trace_stats
from agentx.errors import AgentXError, TraceError


def req(t, n_in, n_out, ids, think=0.0, kind="n"):
    return {
        "t": t,
        "type": kind,
        "in": n_in,
        "out": n_out,
        "hash_ids": ids,
        "input_types": ["text"],
        "output_types": ["text"],
        "stop": "end_turn",
        "api_time": 1.5,
        "think_time": think,
    }


def session(sid="s1", scope="local"):
    return {
        "id": sid,
        "block_size": 64,
        "hash_id_scope": scope,
        "tool_tokens": 100,
        "system_tokens": 28,
        "requests": [
            req(0.0, 100, 10, [1, 2], kind="s"),
            req(2.0, 200, 20, [1, 2, 3, 4], think=0.5),
            {
                "t": 3.0,
                "type": "subagent",
                "agent_id": "a1",
                "subagent_type": "Explore",
                "duration_ms": 1200,
                "requests": [req(3.0, 130, 5, [1, 2, 9])],
            },
            {
                "t": 3.0,
                "type": "subagent",
                "agent_id": "a2",
                "subagent_type": "Explore",
                "duration_ms": None,
                "requests": [req(3.0, 64, 5, [7])],
            },
            req(5.0, 300, 30, [1, 2, 3, 4, 5]),
        ],
    }


def write(tmp_path, name, obj):
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def test_agentx_single_session(tmp_path):
    trace = load_agentx(write(tmp_path, "one.json", session()))
    assert trace.trace_id == "s1" and trace.block_size == 64 and trace.source_format == "agentx"
    [s] = trace.sessions
    assert (s.session_id, s.scope, s.system_tokens, s.tool_tokens) == ("s1", "s1", 28, 100)
    first, second, a1, a2, last = s.steps
    assert first == TraceRequest(
        0.0, 100, 10, (1, 2), 0.0, "s", 1.5, "end_turn", ("text",), ("text",)
    )
    assert second.think_time == 0.5 and second.hash_ids == (1, 2, 3, 4)
    assert isinstance(a1, Subagent) and a1.agent_id == "a1" and a1.duration_ms == 1200.0
    assert a2.duration_ms is None and a2.steps[0].num_input_tokens == 64
    assert last.num_output_tokens == 30
    groups = group_steps(s.steps)
    assert [type(g).__name__ for g in groups] == [
        "TraceRequest",
        "TraceRequest",
        "tuple",
        "TraceRequest",
    ]
    assert [x.agent_id for x in groups[2]] == ["a1", "a2"]
    # depth-first order; block sizes 64 and the partial rest
    assert [r.num_input_tokens for _, r in trace.iter_requests()] == [100, 200, 130, 64, 300]
    # hits: req2 blocks 1,2 (64+64); sub a1 blocks 1,2 (128); a2 none; last 1..4 (256)
    assert theoretical_hits(trace) == [0, 128, 128, 0, 256]
    stats = trace_stats(trace)
    assert stats.num_prompt_tokens == 794 and stats.theoretical_hit_tokens == 512
    assert stats.median_turns == 3.0 and stats.median_subagents == 2.0
    assert stats.subagent_session_fraction == 1.0


def test_agentx_jsonl_and_list_and_scopes(tmp_path):
    lines = json.dumps(session("a")) + "\n\n" + json.dumps(session("b")) + "\n"
    trace = load_agentx(write(tmp_path, "many.jsonl", lines))
    assert trace.trace_id == "many" and [s.scope for s in trace.sessions] == ["a", "b"]
    # local scope: session b's ids are its own, so its first request hits nothing
    assert theoretical_hits(trace)[5] == 0
    listed = load_agentx(
        write(tmp_path, "list.json", [session("a", "global"), session("b", "global")])
    )
    assert [s.scope for s in listed.sessions] == ["", ""]
    assert theoretical_hits(listed)[5] == 100  # blocks 1 and 2 seen in session a (64 + 36)


def test_agentx_roundtrip(tmp_path):
    trace = load_agentx(write(tmp_path, "one.json", session(scope="global")))
    out = tmp_path / "out.jsonl"
    dump_agentx(trace, out)
    again = load_agentx(out)
    assert again.sessions == trace.sessions


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s["requests"][1].pop("in"), "bad.json: requests[1]: field 'in': missing"),
        (
            lambda s: s["requests"][2]["requests"][0].__setitem__("hash_ids", [1, "x"]),
            "bad.json: requests[2].requests[0]: field 'hash_ids': item 1: expected an integer, "
            "got str 'x'",
        ),
        (
            lambda s: s["requests"][0].__setitem__("type", "q"),
            "bad.json: requests[0]: field 'type': expected 's', 'n' or 'subagent', got 'q'",
        ),
        (
            lambda s: s["requests"][0].__setitem__("out", -1),
            "bad.json: requests[0]: field 'out': expected an integer >= 0, got -1",
        ),
        (
            lambda s: s["requests"][4].__setitem__("t", "soon"),
            "bad.json: requests[4]: field 't': expected a number, got str 'soon'",
        ),
        (
            lambda s: s.__setitem__("hash_id_scope", "galaxy"),
            "bad.json: field 'hash_id_scope': expected 'local' or 'global', got 'galaxy'",
        ),
        (lambda s: s.pop("requests"), "bad.json: field 'requests': missing"),
    ],
)
def test_agentx_invalid_names_file_record_field(tmp_path, mutate, message):
    obj = session()
    mutate(obj)
    path = write(tmp_path, "bad.json", obj)
    with pytest.raises(TraceError) as info:
        load_agentx(path)
    assert str(info.value) == f"{tmp_path}/{message}"
    assert isinstance(info.value, AgentXError) and isinstance(info.value, ValueError)


def test_agentx_invalid_jsonl_line(tmp_path):
    path = write(tmp_path, "bad.jsonl", json.dumps(session()) + "\n{not json\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl: line 2: invalid JSON"):
        load_agentx(path)
    bad = session()
    bad["requests"][0]["hash_ids"] = 5
    path = write(tmp_path, "bad2.jsonl", json.dumps(session("x")) + "\n" + json.dumps(bad))
    with pytest.raises(TraceError) as info:
        load_agentx(path)
    assert str(info.value).endswith(
        "bad2.jsonl: line 2: requests[0]: field 'hash_ids': expected a list of integers, got int 5"
    )


MOONCAKE = (
    '{"timestamp": 0, "input_length": 655, "output_length": 52, "hash_ids": [46, 47]}\n'
    '{"timestamp": 10535, "input_length": 672, "output_length": 26, "hash_ids": [46, 47]}\n'
)


def test_mooncake(tmp_path):
    path = write(tmp_path, "mc.jsonl", MOONCAKE)
    trace = load_trace(path)
    assert trace.source_format == "mooncake" and trace.block_size == 512
    assert [s.start_time for s in trace.sessions] == [0.0, 10.535]
    assert trace.sessions[1] == SessionTrace(
        "r1", (TraceRequest(0.0, 672, 26, (46, 47)),), "", start_time=10.535
    )
    # second request: block 46 (512) and 47 (160 of 672) were seen
    assert theoretical_hits(trace) == [0, 672]


def test_mooncake_invalid(tmp_path):
    path = write(tmp_path, "mc.jsonl", MOONCAKE + '{"timestamp": 1, "input_length": 3.5}\n')
    with pytest.raises(TraceError) as info:
        load_mooncake(path)
    assert str(info.value) == (
        f"{path}: line 3: field 'input_length': expected an integer, got float 3.5"
    )
    path = write(tmp_path, "mc2.jsonl", '{"timestamp": 1, "input_length": 3, "output_length": 1}')
    with pytest.raises(TraceError, match="line 1: field 'hash_ids': missing"):
        load_mooncake(path)


def test_load_trace_detects_format_and_empty_files(tmp_path):
    assert load_trace(write(tmp_path, "w.jsonl", json.dumps(session()))).source_format == "agentx"
    with pytest.raises(TraceError, match="no sessions"):
        load_trace(write(tmp_path, "e.jsonl", "\n"))
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.json")
    assert isinstance(Trace("x", 64, ()), Trace)
