"""The prefill share while requests decode: exact per-step token counts with a fixed cost model,
the adaptive model converging on a fake clock, and the step times the scheduler measures."""

import math
from dataclasses import astuple

import pytest

from agentx.config import SchedulerConfig
from agentx.engine.scheduler import (
    AdaptiveStepCost,
    FixedStepCost,
    StepCost,
    StepCostModel,
    make_step_cost,
)
from agentx.errors import ConfigError
from tests.helpers.kv import make_request
from tests.helpers.scheduler import COST, make_scheduler, step

LONG = 2048


def start_decodes(s, max_tokens=40):
    """Four 8-token requests, admitted in one step; afterwards each decodes one token a step."""
    for i, rid in enumerate("abcd"):
        s.add_request(make_request(rid, list(range(10 * i, 10 * i + 8)), max_tokens=max_tokens))
    assert step(s) == dict.fromkeys("abcd", 8)


DECODES = dict.fromkeys("abcd", 1)


def test_long_prompt_gets_the_cost_models_share_while_four_requests_decode():
    s = make_scheduler()
    start_decodes(s)
    s.add_request(make_request("long", list(range(100, 100 + LONG))))
    for _ in range(5):
        assert step(s) == {**DECODES, "long": 136}
    assert s.requests["long"].num_computed_tokens == 5 * 136


def test_long_prompt_gets_the_whole_budget_once_nothing_decodes():
    s = make_scheduler()
    s.add_request(make_request("long", list(range(100, 100 + LONG))))
    assert step(s) == {"long": 2048}
    # the same while decodes run, with the policy off
    s = make_scheduler(decode_step_target_ms=0)
    start_decodes(s)
    s.add_request(make_request("long", list(range(100, 100 + LONG))))
    assert step(s) == {**DECODES, "long": 2044}


def test_share_returns_to_the_whole_budget_when_the_decodes_finish():
    s = make_scheduler()
    start_decodes(s, max_tokens=3)  # the admission step sampled the first token: 2 decode steps
    s.add_request(make_request("long", list(range(100, 100 + LONG))))
    assert step(s) == {**DECODES, "long": 136}
    assert step(s) == {**DECODES, "long": 136}
    assert step(s) == {"long": LONG - 2 * 136}  # a..d finished: nothing decodes
    assert s.requests["long"].num_output_tokens == 1


def test_share_never_drops_below_the_floor():
    # 40 ms cannot hold 4 decodes and a chunk (20 + 2 + 10 = 32 ms, 16 tokens), floor 64
    s = make_scheduler(decode_step_target_ms=40.0, decode_step_min_prefill_tokens=64)
    start_decodes(s)
    s.add_request(make_request("long", list(range(100, 100 + LONG))))
    assert step(s) == {**DECODES, "long": 64}
    s = make_scheduler(decode_step_target_ms=40.0, decode_step_min_prefill_tokens=8)
    start_decodes(s)
    s.add_request(make_request("long", list(range(100, 100 + LONG))))
    assert step(s) == {**DECODES, "long": 16}


def test_chunks_share_in_admission_order_and_decodes_still_run():
    s = make_scheduler()
    start_decodes(s)
    s.add_request(make_request("p", list(range(100, 300))))
    s.add_request(make_request("q", list(range(300, 500))))
    assert step(s) == {**DECODES, "p": 136}  # the share is spent: q waits, in order
    assert step(s) == {**DECODES, "p": 64, "q": 72}  # p's last 64, q the rest of the share
    # p now decodes too: 5 decodes and one chunk: 100 - (20 + 2.5 + 12) = 65.5 ms -> 131 tokens
    assert step(s) == {**DECODES, "p": 1, "q": 128}  # q has only 128 left
    assert s.requests["q"].num_output_tokens == 1


def test_drafts_kept_stretch_the_target_by_the_fewest_tokens_a_decode_kept():
    s = make_scheduler()
    start_decodes(s)
    s.add_request(make_request("long", list(range(100, 100 + LONG))))
    # four decodes that each ran 1 + 4 drafts; the slowest kept 3 tokens, in every recent step
    for _ in range(8):
        s._decode_steps.append((3, 5.0))
    # 3 x 100 ms for 20 decode rows and a chunk: 300 - (20 + 10 + 5 x 2) = 260 ms -> 520 tokens
    assert s._decode_yield() == (3.0, 5.0)
    assert step(s) == {**DECODES, "long": 520}
    # this step's decodes kept one token each (no drafts): the average moves toward (1, 1)
    assert s._decode_steps[-1] == (1, 1.0)
    assert s._decode_yield() == (2.75, 4.5)


def test_without_drafts_a_decode_keeps_one_token_a_step():
    s = make_scheduler()
    start_decodes(s)
    for _ in range(3):
        step(s)
    assert list(s._decode_steps) == [(1, 1.0)] * 3
    assert s._decode_yield() == (1.0, 1.0)


def test_long_prefill_threshold_still_caps_below_the_share():
    s = make_scheduler(long_prefill_token_threshold=100)
    start_decodes(s)
    s.add_request(make_request("long", list(range(100, 100 + LONG))))
    assert step(s) == {**DECODES, "long": 100}


def test_prefill_schedule_interval_still_holds_new_prefills():
    s = make_scheduler(prefill_schedule_interval=3)
    start_decodes(s)  # step 0
    s.add_request(make_request("long", list(range(100, 100 + LONG))))
    assert step(s) == DECODES  # step 1
    assert step(s) == DECODES  # step 2
    assert step(s) == {**DECODES, "long": 136}  # step 3: admitted, with the share
    assert step(s) == {**DECODES, "long": 136}  # running chunks continue every step


def test_adaptive_model_converges_on_a_fake_clock():
    # the prior thinks steps cost ~3x what the fake machine's do: 4 decodes already fill 100 ms,
    # so the first chunk is the floor; measured steps then grow it to the machine's 136
    prior = StepCost(base_ms=45.0, token_ms=1.9, request_ms=5.0)
    s = make_scheduler(cost_model=AdaptiveStepCost(prior))
    start_decodes(s, max_tokens=200)
    s.add_request(make_request("long", list(range(100, 100 + LONG))))
    chunks = [step(s)["long"] for _ in range(10)]
    assert chunks[0] == 64
    assert chunks == sorted(chunks)
    assert all(abs(c - 136) <= 1 for c in chunks[-4:]), chunks  # floor() of a fitted float
    fitted = s.cost_model.get_cost()
    assert fitted.estimate_ms(4 + 136, 5) == pytest.approx(COST.estimate_ms(4 + 136, 5), rel=1e-2)
    assert fitted.token_ms == pytest.approx(0.5, rel=2e-2)


def test_adaptive_model_fits_exact_steps_and_keeps_what_decodes_do_not_say():
    model = AdaptiveStepCost(StepCost(45.0, 1.9, 5.0))
    assert model.get_cost() == StepCost(45.0, 1.9, 5.0)  # the prior until a step is seen
    for num_tokens, num_requests in [(4, 4), (140, 5), (8, 8), (300, 2), (4, 4), (64, 3)] * 4:
        model.observe(num_tokens, num_requests, COST.estimate_ms(num_tokens, num_requests))
    for value, want in zip(astuple(model.get_cost()), (20.0, 0.5, 2.0), strict=True):
        assert value == pytest.approx(want, rel=1e-6)
    # 500 decode-only steps say nothing about a token's cost: the fit keeps it
    for _ in range(500):
        model.observe(4, 4, COST.estimate_ms(4, 4))
    for value, want in zip(astuple(model.get_cost()), (20.0, 0.5, 2.0), strict=True):
        assert value == pytest.approx(want, rel=1e-6)
    # the machine turns twice as slow: some 80 steps of both kinds re-fit it
    slow = StepCost(40.0, 1.0, 4.0)
    for num_tokens, num_requests in [(4, 4), (140, 5), (8, 8), (300, 2)] * 20:
        model.observe(num_tokens, num_requests, slow.estimate_ms(num_tokens, num_requests))
    for value, want in zip(astuple(model.get_cost()), (40.0, 1.0, 4.0), strict=True):
        assert value == pytest.approx(want, rel=1e-2)
    assert model.num_observed == 24 + 500 + 80


def test_adaptive_model_ignores_steps_it_cannot_use():
    model = AdaptiveStepCost(StepCost(45.0, 1.9, 5.0))
    for args in [(0, 0, 5.0), (4, 4, math.nan), (4, 4, math.inf), (4, 4, -1.0)]:
        model.observe(*args)
    assert model.num_observed == 0 and model.get_cost() == StepCost(45.0, 1.9, 5.0)


def test_fitted_costs_are_never_negative():
    model = AdaptiveStepCost(StepCost(45.0, 1.9, 5.0))
    for num_tokens, num_requests, ms in [(4, 4, 100.0), (200, 1, 1.0), (2, 2, 400.0)] * 3:
        model.observe(num_tokens, num_requests, ms)
    cost = model.get_cost()
    assert cost.base_ms >= 0 and cost.token_ms > 0 and cost.request_ms >= 0


def test_step_cost_counts_tokens_that_fit():
    assert COST.estimate_ms(10, 2) == 20 + 5 + 4
    assert COST.get_num_tokens(100.0, 4, 4) == 136
    assert COST.get_num_tokens(32.0, 4, 4) == 0  # the decodes alone use the target
    assert COST.get_num_tokens(10.0, 4, 4) == 0


class RecordingCost(StepCostModel):
    def __init__(self) -> None:
        self.seen = []

    def get_cost(self) -> StepCost:
        return COST

    def observe(self, num_tokens, num_requests, step_ms) -> None:
        self.seen.append((num_tokens, num_requests, step_ms))


def test_scheduler_times_each_step_from_schedule_to_update():
    recorder = RecordingCost()
    s = make_scheduler(cost_model=recorder)
    start_decodes(s)
    step(s)
    s.schedule()  # nothing to schedule: no step, nothing observed
    for (tokens, requests, ms), want in zip(recorder.seen, [(32, 4), (4, 4)], strict=True):
        assert (tokens, requests) == want
        assert ms == pytest.approx(COST.estimate_ms(*want))
    assert len(recorder.seen) == 2


def test_config_builds_the_model_and_rejects_bad_values():
    fixed = make_step_cost(SchedulerConfig(step_cost_model="fixed", step_cost_base_ms=7.0))
    assert isinstance(fixed, FixedStepCost) and fixed.get_cost() == StepCost(7.0, 1.9, 5.0)
    assert isinstance(make_step_cost(SchedulerConfig()), AdaptiveStepCost)
    for bad in (
        {"decode_step_target_ms": -1.0},
        {"decode_step_target_ms": math.nan},
        {"decode_step_min_prefill_tokens": 0},
        {"step_cost_model": "oracle"},
        {"step_cost_token_ms": 0.0},
        {"step_cost_token_ms": math.inf},
        {"step_cost_base_ms": -5.0},
        {"step_cost_request_ms": math.nan},
    ):
        with pytest.raises(ConfigError):
            SchedulerConfig(**bad)
    with pytest.raises(ConfigError):
        AdaptiveStepCost(COST, decay=1.0)


def test_short_turns_are_admitted_whole_past_the_share():
    # short_turn_tokens=256: two 120-token turns arriving together (a subagent burst) both run
    # whole in one step beside the decodes, 104 tokens past the 136-token share; a 300-token turn
    # does not count as short and gets the share as before
    s = make_scheduler(short_turn_tokens=256)
    start_decodes(s)
    s.add_request(make_request("x", list(range(100, 220))))
    s.add_request(make_request("y", list(range(300, 420))))
    s.add_request(make_request("long", list(range(500, 800))))
    assert step(s) == {**DECODES, "x": 120, "y": 120}
    # six decodes now: 100 - (20 + 6 * 0.5 + 7 * 2) = 63 ms, 126 tokens for the long one
    assert step(s) == {**DECODES, "x": 1, "y": 1, "long": 126}


def test_short_turns_take_at_most_short_turn_tokens_past_the_share_a_step():
    # three 200-token turns: x takes 64 past the 136-token share (192 of 256 left), y would take
    # 200 and waits (z behind it, in order); next step the share is 131 (five decodes: 100 -
    # (20 + 5 * 0.5 + 6 * 2) = 65.5 ms), y takes 69 past it, and z, 200 past a spent share, waits
    # again; then z alone (share 126, 74 past it)
    s = make_scheduler(short_turn_tokens=256)
    start_decodes(s)
    for rid, first in (("x", 100), ("y", 300), ("z", 500)):
        s.add_request(make_request(rid, list(range(first, first + 200))))
    assert step(s) == {**DECODES, "x": 200}
    assert step(s) == {**DECODES, "x": 1, "y": 200}
    assert step(s) == {**DECODES, "x": 1, "y": 1, "z": 200}


def test_without_short_turns_a_burst_trickles_in_at_the_share():
    s = make_scheduler()
    start_decodes(s)
    s.add_request(make_request("x", list(range(100, 300))))
    s.add_request(make_request("y", list(range(300, 500))))
    assert step(s) == {**DECODES, "x": 136}
    assert step(s) == {**DECODES, "x": 64, "y": 72}


def test_short_turn_tokens_validation():
    with pytest.raises(ConfigError, match="short_turn_tokens"):
        SchedulerConfig(short_turn_tokens=-1)
