"""The trace synthesizer: published statistics, determinism, scaling, and prompt structure."""

import math

import pytest

from agentx.bench.format_agentx import dump_agentx, load_agentx
from agentx.bench.synth import SynthConfig, synthesize
from agentx.bench.trace import Subagent, TraceRequest
from agentx.bench.trace_stats import trace_stats
from agentx.errors import ConfigError


@pytest.fixture(scope="module")
def large():
    return synthesize(SynthConfig(num_sessions=200, seed=0))


def _within(value: float, target: float, tolerance: float = 0.10) -> bool:
    return abs(value - target) <= tolerance * target


def test_published_statistics(large):
    """``synth --scale 1`` reproduces the published figures, each within 10%."""
    stats = trace_stats(large)
    assert stats.num_sessions == 200
    assert _within(stats.median_input_tokens, 142_000)  # per request
    assert _within(stats.median_output_tokens, 444)
    assert _within(stats.median_turns, 43)  # root turns per session
    assert stats.theoretical_hit_rate > 0.96
    assert _within(stats.subagent_session_fraction, 0.44)
    assert _within(stats.median_subagents, 4)  # among sessions with subagents
    assert stats.max_input_tokens <= 200_000


def test_agents_compact_at_the_context_limit(large):
    c = SynthConfig()
    shared = (c.system_tokens + c.tool_tokens) // c.block_size
    compactions = 0
    for session in large.sessions[:40]:
        turns = [s for s in session.steps if isinstance(s, TraceRequest)]
        for prev, cur in zip(turns, turns[1:], strict=False):
            if cur.num_input_tokens < prev.num_input_tokens + prev.num_output_tokens:
                compactions += 1  # a fresh context: the shared prefix, then new blocks only
                assert cur.hash_ids[:shared] == prev.hash_ids[:shared]
                assert not set(cur.hash_ids[shared:]) & set(prev.hash_ids)
                assert prev.num_input_tokens > 100_000
    assert compactions > 0


def test_output_scale_is_separate():
    trace = synthesize(SynthConfig(num_sessions=8, scale=0.05, output_scale=0.25,
                                   max_context_tokens=8192))  # fmt: skip
    stats = trace_stats(trace)
    assert stats.median_output_tokens >= 100  # the CLI's CPU-sized default
    assert stats.median_turns <= 12  # turns still follow ``scale``
    with pytest.raises(ConfigError, match="output_scale"):
        SynthConfig(output_scale=0)


def test_prompts_grow_from_the_shared_prefix(large):
    c = SynthConfig()
    shared_blocks = (c.system_tokens + c.tool_tokens) // c.block_size  # 281 full blocks
    firsts = [s.steps[0] for s in large.sessions]
    # every session starts with the same system + tool blocks
    assert len({f.hash_ids[:shared_blocks] for f in firsts}) == 1
    for session in large.sessions[:20]:
        turns = [s for s in session.steps if isinstance(s, TraceRequest)]
        for prev, cur in zip(turns, turns[1:], strict=False):
            if cur.num_input_tokens < prev.num_input_tokens + prev.num_output_tokens:
                continue  # compacted (test_agents_compact_at_the_context_limit)
            full = prev.num_input_tokens // 64
            assert cur.hash_ids[:full] == prev.hash_ids[:full]
        for r in session.iter_requests():
            assert len(r.hash_ids) == math.ceil(r.num_input_tokens / 64)
            assert r.num_input_tokens + r.num_output_tokens <= 200_000


def test_subagents_fork_from_the_parent_context(large):
    spawning = [s for s in large.sessions if any(isinstance(x, Subagent) for x in s.steps)]
    for session in spawning[:20]:
        steps = list(session.steps)
        k = next(i for i, x in enumerate(steps) if isinstance(x, Subagent))
        parent = steps[k - 1]
        assert isinstance(parent, TraceRequest)
        full = parent.num_input_tokens // 64
        group = [x for x in steps[k:] if isinstance(x, Subagent)]
        for sub in group:
            first = sub.steps[0]
            assert first.hash_ids[:full] == parent.hash_ids[:full]
            assert first.num_input_tokens > parent.num_input_tokens + parent.num_output_tokens
            assert sub.t == group[0].t
        # the rollouts' own task blocks differ
        tails = {sub.steps[0].hash_ids[full:] for sub in group}
        assert len(tails) == len(group)


def test_deterministic_and_seeded(tmp_path):
    config = SynthConfig(num_sessions=6, seed=3, scale=0.05, max_context_tokens=8192)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    dump_agentx(synthesize(config), a)
    dump_agentx(synthesize(config), b)
    assert a.read_bytes() == b.read_bytes()
    other = synthesize(SynthConfig(num_sessions=6, seed=4, scale=0.05, max_context_tokens=8192))
    assert other.sessions != load_agentx(a).sessions
    # sessions are seeded one by one: asking for more sessions keeps the first ones' shapes
    more = synthesize(SynthConfig(num_sessions=7, seed=3, scale=0.05, max_context_tokens=8192))
    sizes = [[r.num_input_tokens for r in s.iter_requests()] for s in more.sessions[:6]]
    assert sizes == [
        [r.num_input_tokens for r in s.iter_requests()] for s in load_agentx(a).sessions
    ]


def test_scale_fits_the_context():
    config = SynthConfig(num_sessions=8, scale=0.05, output_scale=0.25, max_context_tokens=7680)
    trace = synthesize(config)
    stats = trace_stats(trace)
    # the CLI's default scaled trace, exactly (the same on every machine)
    assert (stats.num_requests, stats.num_prompt_tokens, stats.num_output_tokens) == (
        99,
        549119,
        15970,
    )
    assert stats.theoretical_hit_tokens == 491264
    assert 6 <= stats.median_turns <= 12  # 43 * sqrt(0.05) = 9.6
    assert 100 <= stats.median_output_tokens <= 125  # 444 * 0.25
    assert stats.max_input_tokens <= 7680
    for _, r in trace.iter_requests():
        assert r.num_input_tokens + r.num_output_tokens <= 7680 and r.num_output_tokens >= 2
    tiny = synthesize(SynthConfig(num_sessions=4, scale=0.01, max_context_tokens=600))
    assert all(r.num_input_tokens + r.num_output_tokens <= 600 for _, r in tiny.iter_requests())


def test_bad_config():
    with pytest.raises(ConfigError, match="scale"):
        SynthConfig(scale=0)
    with pytest.raises(ConfigError, match="num_sessions"):
        SynthConfig(num_sessions=0)
