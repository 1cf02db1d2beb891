"""First-turn lanes: exact per-step token counts for cold first turns beside warm turns, with
lanes off as the baseline, and greedy tokens unchanged by lanes in a real engine."""

import pytest

from agentx import SamplingParams, SchedulerConfig
from agentx.errors import ConfigError
from tests.helpers.kv import make_request
from tests.helpers.scheduler import make_scheduler, step

# no decodes in these steps' way: the chunk share is the whole 256-token budget; a request
# admitted with more than 512 tokens to compute is cold, and its lane's share is 64 tokens
LANES = dict(max_num_batched_tokens=256, decode_step_target_ms=0.0, cold_prefill_tokens=512)
COLD = list(range(1000, 1000 + 2048))


def warm(rid: str, n: int, base: int) -> object:
    return make_request(rid, list(range(base, base + n)))


def test_without_lanes_a_warm_turn_waits_behind_every_chunk_of_a_cold_one():
    s = make_scheduler(**{**LANES, "cold_prefill_tokens": 0})
    s.add_request(make_request("cold", COLD))
    assert step(s) == {"cold": 256}
    s.add_request(warm("warm", 64, 0))
    for _ in range(7):  # the cold prompt's other 1792 tokens first
        assert step(s) == {"cold": 256}
    assert step(s) == {"cold": 1, "warm": 64}  # the cold turn's first decode beside it


def test_a_warm_turn_runs_at_once_beside_a_cold_prefill():
    s = make_scheduler(**LANES)
    s.add_request(make_request("cold", COLD))
    assert step(s) == {"cold": 256}  # alone, the cold lane takes everything
    assert s.requests["cold"].in_cold_lane
    s.add_request(warm("warm", 64, 0))
    # the warm turn is served whole, so the cold lane takes what it left
    assert step(s) == {"warm": 64, "cold": 192}
    assert s.requests["warm"].in_cold_lane is False


def test_wanting_warm_turns_hold_the_cold_lane_to_its_share():
    s = make_scheduler(**LANES)
    s.add_request(make_request("cold", COLD))
    step(s)
    s.add_request(warm("w1", 150, 0))
    s.add_request(warm("w2", 150, 200))
    # 64 kept for the cold lane; the warm lane's 192: w1 whole, w2 clipped to 42
    assert step(s) == {"w1": 150, "w2": 42, "cold": 64}
    # w1 decodes; w2's other 108 fit in the warm lane's share, and then nothing warm wants more
    assert step(s) == {"w1": 1, "w2": 108, "cold": 147}
    assert s.requests["cold"].num_computed_tokens == 256 + 64 + 147


def test_warm_turns_are_admitted_ahead_of_an_earlier_cold_one():
    s = make_scheduler(**LANES)
    s.add_request(make_request("cold", COLD))
    s.add_request(warm("warm", 64, 0))
    assert step(s) == {"warm": 64, "cold": 192}
    baseline = make_scheduler(**{**LANES, "cold_prefill_tokens": 0})
    baseline.add_request(make_request("cold", COLD))
    baseline.add_request(warm("warm", 64, 0))
    assert step(baseline) == {"cold": 256}


def test_a_cold_turn_leaves_its_lane_when_its_prompt_is_computed():
    s = make_scheduler(**{**LANES, "max_num_batched_tokens": 1024})
    s.add_request(make_request("cold", COLD[:1024]))
    assert step(s) == {"cold": 1024}
    request = s.requests["cold"]
    assert request.in_cold_lane and not s.lanes.is_cold(request)  # now it decodes
    s.add_request(warm("warm", 600, 0))  # 600 > 512: a cold turn too, alone in its lane
    assert step(s) == {"cold": 1, "warm": 600}


def test_a_prefix_hit_makes_a_long_prompt_warm():
    s = make_scheduler(**LANES)
    s.add_request(make_request("first", COLD[:640], max_tokens=1))
    for _ in range(3):
        step(s)
    assert "first" not in s.requests  # finished; its 40 full blocks stay cached
    s.add_request(make_request("again", COLD[:640] + [7] * 16))
    assert step(s) == {"again": 16}  # the 40 cached blocks: only the 16 new tokens left
    assert s.requests["again"].in_cold_lane is False


BAD_LANES = [
    dict(cold_prefill_tokens=-1),
    dict(cold_prefill_share=0.0),
    dict(cold_prefill_share=1.0),
    dict(cold_prefill_share=float("nan")),
]


@pytest.mark.parametrize("bad", BAD_LANES)
def test_lane_config_is_validated(bad):
    with pytest.raises(ConfigError, match="cold_prefill"):
        SchedulerConfig(**bad)


@pytest.mark.slow
def test_lanes_do_not_change_greedy_tokens(make_engine, greedy_prompts):
    """A long cold prompt and short warm ones together, lanes on, give each prompt's tokens
    alone (lanes reorder work across steps; each row's arithmetic is the same)."""
    long_prompt = [t for p in greedy_prompts for t in p] * 6
    prompts = [long_prompt, *greedy_prompts]
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    lanes = make_engine(
        scheduler=SchedulerConfig(max_num_batched_tokens=128, cold_prefill_tokens=96)
    )
    alone = [lanes.generate([p], sampling)[0].token_ids for p in prompts]
    lanes.core.scheduler.kv.reset_prefix_cache()
    together = lanes.generate(prompts, sampling)
    assert [g.token_ids for g in together] == alone
    lanes.check_integrity()
