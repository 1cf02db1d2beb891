"""Exact-state tests of the token-budget scheduler with a fake runner (no model)."""

import pytest
import torch

from agentx.config import SchedulerConfig
from agentx.engine.kv_cache import LinearStateSpec, SlidingWindowSpec
from agentx.engine.kv_cache.retention import IntervalRetention
from agentx.engine.outputs import ModelRunnerOutput
from agentx.engine.request import RequestStatus
from agentx.engine.scheduler import Scheduler
from agentx.errors import PromptTooLongError
from tests.helpers.kv import FULL, make_kv, make_manager, make_request

LINEAR = LinearStateSpec(4, torch.float32, shapes=((2, 3), (16,)))
SLIDING = SlidingWindowSpec(4, torch.float32, num_kv_heads=1, head_size=8, sliding_window=8)


def fake_run(out):
    """Sample token 1000 + index for every request whose tokens reached its end."""
    return ModelRunnerOutput(
        {s.request_id: 1000 + s.num_output_tokens for s in out.scheduled if s.sample}
    )


def make_scheduler(num_blocks=64, **cfg):
    kv = make_manager(num_blocks)
    return Scheduler(SchedulerConfig(**cfg), kv, max_model_len=256)


def step(sched):
    out = sched.schedule()
    deltas = sched.update_from_output(out, fake_run(out))
    sched.check_integrity()
    return {s.request_id: len(s.token_ids) for s in out.scheduled}, out, deltas


def test_budget_is_shared_running_first():
    s = make_scheduler(max_num_batched_tokens=16)
    for i, rid in enumerate("abc"):
        s.add_request(make_request(rid, list(range(100 * i, 100 * i + 10))))
    n, out, deltas = step(s)
    assert n == {"a": 10, "b": 6}  # b's prefill is clipped by the budget
    assert [d.request_id for d in deltas] == ["a"]
    assert out.scheduled[1].start_position == 0 and out.scheduled[1].sample is False
    n, out, deltas = step(s)
    assert n == {"a": 1, "b": 4, "c": 10}  # 1 + 4 + 10 < 16: all of c fits
    assert [d.request_id for d in deltas] == ["a", "b", "c"]
    assert out.scheduled[1].start_position == 6


def test_same_step_requests_share_blocks_being_computed():
    s = make_scheduler(max_num_batched_tokens=64)
    s.add_request(make_request("a", list(range(10))))
    s.add_request(make_request("b", list(range(10))))
    n, _, _ = step(s)
    assert n == {"a": 10, "b": 2}  # b hit a's two full blocks, computed in this very step
    assert s.requests["b"].num_cached_tokens == 8
    assert s.kv.get_block_ids("b")[0][:2] == s.kv.get_block_ids("a")[0][:2]


def test_long_prefill_threshold_lets_short_turns_interleave():
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    s.add_request(make_request("long", list(range(100, 140))))
    n, _, _ = step(s)
    assert n == {"long": 8}
    s.add_request(make_request("short", list(range(5))))
    n, _, deltas = step(s)
    assert n == {"long": 8, "short": 5}
    assert [d.request_id for d in deltas] == ["short"]
    for _ in range(3):
        step(s)
    assert s.requests["long"].num_computed_tokens == 40
    assert s.requests["long"].num_output_tokens == 1


def test_max_num_seqs_caps_running_requests():
    s = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        s.add_request(make_request(rid, [7, 8, 9]))
    n, _, _ = step(s)
    assert set(n) == {"a", "b"} and len(s.waiting) == 1


def test_preemption_recomputes_and_reuses_the_victims_cached_prefix():
    # 8 usable blocks of 4 tokens; two 12-token prompts growing by one token a step
    s = make_scheduler(num_blocks=9, max_num_batched_tokens=64)
    s.add_request(make_request("a", list(range(12)), max_tokens=8))
    s.add_request(make_request("b", list(range(100, 112)), max_tokens=20))
    step(s)
    assert s.kv.get_num_used_blocks() == 6
    step(s)  # position 12 opens a fourth block each
    assert s.kv.get_num_used_blocks() == 8
    for _ in range(3):
        step(s)  # positions 13..15
    assert s.num_preemptions == 0
    n, out, _ = step(s)  # a's position 16 needs a fifth block: b, admitted last, is preempted
    assert n == {"a": 1} and s.num_preemptions == 1
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.all_token_ids[12:] == [1000, 1001, 1002, 1003, 1004]
    assert s.kv.get_block_ids("b") == ([],)
    assert s.kv.get_num_used_blocks() == 5
    # b's blocks were freed tail first, so a's fifth block evicted b's last block only
    assert s.kv.pool.num_evictions == 1
    while "a" in s.requests:
        step(s)
    n, out, _ = step(s)
    item = out.scheduled[0]
    assert item.request_id == "b" and item.is_new
    assert item.start_position == 12 and item.token_ids == [1000, 1001, 1002, 1003, 1004]
    assert out.finished_request_ids == frozenset({"a"})
    assert b.num_cached_tokens == 0  # usage reports the hit of its first admission


def test_priority_policy_orders_admission_and_picks_the_victim():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    s.add_request(make_request("low", [1, 2, 3], priority=5))
    s.add_request(make_request("high", [4, 5, 6], priority=-1))
    n, _, _ = step(s)
    assert n == {"high": 3}


def test_prefill_schedule_interval_holds_new_prefills_while_decoding():
    s = make_scheduler(prefill_schedule_interval=3)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    step(s)  # step 0: admitted (nothing running)
    s.add_request(make_request("b", [4, 5, 6]))
    n1, _, _ = step(s)
    n2, _, _ = step(s)
    n3, _, _ = step(s)
    assert n1 == {"a": 1} and n2 == {"a": 1} and n3 == {"a": 1, "b": 3}


def test_request_that_can_never_fit_is_rejected():
    s = make_scheduler(num_blocks=5)  # 16 tokens of KV
    with pytest.raises(
        PromptTooLongError, match=r"up to 17 tokens .* 5 blocks, but the pool holds 4"
    ):
        s.add_request(make_request("big", list(range(10)), max_tokens=7))
    with pytest.raises(PromptTooLongError, match="prompt has 256 tokens; the model context is 256"):
        s.check_fits(256, 1)  # the engine's own check, on the caller's thread
    s.add_request(make_request("ok", list(range(10)), max_tokens=6))
    assert set(s.requests) == {"ok"}


def test_abort_frees_every_block_and_tells_the_runner():
    s = make_scheduler()
    s.add_request(make_request("a", list(range(10))))
    s.add_request(make_request("w", list(range(50, 60))))
    step(s)
    ended = s.finish_requests(["a", "w", "missing"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in ended] == ["a", "w"]
    assert s.kv.get_num_used_blocks() == 0 and not s.has_unfinished_requests()
    out = s.schedule()
    assert out.finished_request_ids == frozenset({"a", "w"})
    s.check_integrity()


def test_finished_request_releases_blocks_and_reports_length():
    s = make_scheduler()
    s.add_request(make_request("a", [1, 2, 3], max_tokens=3))
    deltas = []
    while s.has_unfinished_requests():
        deltas += step(s)[2]
    assert [d.new_token_ids[0] for d in deltas] == [1000, 1001, 1002]
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 3
    assert s.kv.get_num_used_blocks() == 0


def test_priority_victim_already_scheduled_this_step_gives_back_its_budget():
    s = make_scheduler(num_blocks=5, max_num_batched_tokens=64, policy="priority")
    s.add_request(make_request("x", [1, 2, 3, 4], max_tokens=10, priority=9))
    step(s)  # x alone: one block
    s.add_request(make_request("y", [5, 6, 7, 8, 9, 10], max_tokens=10, priority=0))
    step(s)  # x opens its second block, y takes two: the pool (4 blocks) is full
    assert s.kv.pool.num_free_blocks == 0
    step(s)
    step(s)
    # x (scheduled first, in running order) fits; y's position 8 needs a third block, and the
    # policy's victim is x, the worse priority, although x was already given tokens this step
    n, out, deltas = step(s)
    assert n == {"y": 1}
    assert [d.request_id for d in deltas] == ["y"]
    x = s.requests["x"]
    assert x.status == RequestStatus.PREEMPTED and x.num_computed_tokens == 0
    assert x.num_output_tokens == 4  # tokens sampled before preemption are kept
    assert s.kv.get_block_ids("x") == ([],)
    assert len(s.kv.get_block_ids("y")[0]) == 3


def test_a_request_alone_in_a_pool_too_small_for_its_checkpoints_is_served():
    # full attention + linear state, checkpoints every block: the 24-token prefill plans 6
    # checkpoint pages beside its 6 full blocks, more than the 9-block pool; admitted with its
    # running page only, it finishes (before the fix it waited forever: a bounded loop here)
    kv = make_kv(10, specs=(FULL, LINEAR), retention=IntervalRetention(4))
    s = Scheduler(SchedulerConfig(), kv, max_model_len=256)
    request = make_request("a", list(range(24)), max_tokens=4)
    s.add_request(request)  # check_fits: 7 full blocks + 2 linear pages of 9
    for _ in range(8):
        step(s)
        if request.is_finished:
            break
    assert request.output_token_ids == [1000, 1001, 1002, 1003]
    assert s.num_preemptions == 0 and kv.stats.num_dropped_checkpoints == 5
    assert kv.get_num_used_blocks() == 0


def test_a_request_alone_runs_the_chunk_a_sliding_window_leaves_room_for():
    # full attention + a window of 8: 40 + 4 tokens need 11 full blocks and 4 window blocks, the
    # 15 of the pool; a 40-token chunk needs 10 of each at once, so it runs as 28 then 12 (the
    # window's blocks go back as it moves on) instead of waiting forever
    kv = make_kv(16, specs=(FULL, SLIDING))
    s = Scheduler(SchedulerConfig(), kv, max_model_len=256)
    request = make_request("a", list(range(40)), max_tokens=4)
    s.add_request(request)
    chunks = []
    for _ in range(8):
        chunks.append(step(s)[0].get("a"))
        if request.is_finished:
            break
    assert chunks == [28, 12, 1, 1, 1]
    assert request.output_token_ids == [1000, 1001, 1002, 1003]
    assert s.num_preemptions == 0 and kv.get_num_used_blocks() == 0
