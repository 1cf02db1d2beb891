"""Prefill windows (``prefill_schedule_interval``) over a step index shared by DP replicas: the
exact step indices at which each scheduler admits new prefills, with and without the clock."""

import pytest

from agentx.config import SchedulerConfig
from agentx.engine.outputs import ModelRunnerOutput
from agentx.engine.scheduler import PrefillCadence, Scheduler, StepClock
from tests.helpers.kv import make_manager, make_request


def make_scheduler(clock: StepClock | None) -> Scheduler:
    config = SchedulerConfig(prefill_schedule_interval=3, step_cost_model="fixed")
    return Scheduler(config, make_manager(64), max_model_len=256, step_clock=clock)


def step(s: Scheduler) -> tuple[int, list[str]]:
    """One step; its index and the requests admitted in it."""
    out = s.schedule()
    s.update_from_output(
        out, ModelRunnerOutput({r.request_id: 7 for r in out.scheduled if r.sample})
    )
    s.check_integrity()
    return s.cadence.index, [r.request_id for r in out.scheduled if r.is_new]


def test_cadence_opens_a_window_at_its_first_step_in_each():
    local = PrefillCadence(3)
    assert [local.tick() for _ in range(7)] == [True, False, False, True, False, False, True]
    clock = StepClock()
    a, b = PrefillCadence(3, clock), PrefillCadence(3, clock)
    opened = []
    for who in "aabaaab":  # b steps rarely: it takes the shared index, never a local count
        cadence = a if who == "a" else b
        opened.append((who, cadence.tick(), cadence.index))
    assert opened == [
        ("a", True, 0), ("a", False, 1), ("b", True, 1), ("a", False, 2),
        ("a", True, 3), ("a", False, 4), ("b", True, 4),
    ]  # fmt: skip
    assert clock.get_index() == 4
    with pytest.raises(ValueError):
        PrefillCadence(0)


@pytest.mark.parametrize("aligned", [True, False])
def test_replicas_admit_prefills_in_the_same_steps(aligned):
    clock = StepClock() if aligned else None
    a, b = make_scheduler(clock), make_scheduler(clock)
    a.add_request(make_request("a0", [1, 2, 3], max_tokens=30))
    assert step(a) == (0, ["a0"])
    a.add_request(make_request("a1", [4, 5, 6], max_tokens=30))
    assert step(a) == (1, [])
    # b starts one step late (a first turn arrived there later): alone, it admits at once
    b.add_request(make_request("b0", [7, 8, 9], max_tokens=30))
    assert step(b) == (1 if aligned else 0, ["b0"])
    b.add_request(make_request("b1", [10, 11, 12], max_tokens=30))
    admitted = []  # (round, replica, step index, requests)
    for round_ in range(5):  # in turn, as lockstep ranks step
        for name, s in (("a", a), ("b", b)):
            index, new = step(s)
            if new:
                admitted.append((round_, name, index, new))
    if aligned:  # both open the window in the same round, at shared step 3
        assert admitted == [(1, "a", 3, ["a1"]), (1, "b", 3, ["b1"])]
        assert (a.cadence.index, b.cadence.index) == (6, 6)
    else:  # b's own count is a step behind: it prefills a round later, a step a only decodes
        assert admitted == [(1, "a", 3, ["a1"]), (2, "b", 3, ["b1"])]
        assert (a.cadence.index, b.cadence.index) == (6, 5)
