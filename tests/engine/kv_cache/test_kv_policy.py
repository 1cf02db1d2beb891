"""Programmable KV policies: a custom policy's decisions with exact block states, the built-ins
written on the same hooks, and misbehaving policies refused before they reach the cache."""

import math

import pytest
import torch

from agentx.config import CacheConfig, OffloadConfig
from agentx.engine.kv_cache import (
    CheckpointPlan,
    KVPolicy,
    LinearStateSpec,
    ToolWaitDecision,
    TurnEndDecision,
)
from agentx.engine.kv_cache.retention import IntervalRetention, MarconiRetention
from agentx.engine.offload.build import build_tiered_store
from agentx.engine.offload.manager import OffloadManager
from agentx.errors import ConfigError, KVPolicyError
from tests.helpers.kv import BLOCK_SIZE, FULL, assert_no_leak, make_kv, make_request, run_turn

LINEAR = LinearStateSpec(BLOCK_SIZE, torch.float32, shapes=((2, 3), (16,)))


SYSTEM = list(range(8))  # two blocks of a shared system prompt


class PinSystemPrompt(KVPolicy):
    """Soft-pin the system prompt's blocks; release the biggest held KV first."""

    name = "pin-system"

    def __init__(self):
        self.turns = []

    def on_turn_end(self, turn):
        self.turns.append(turn)
        return TurnEndDecision(soft_pin_blocks=min(2, turn.num_full_blocks))

    def choose_evictions(self, candidates, num_blocks):
        return [c.handle for c in sorted(candidates, key=lambda c: -c.num_blocks)]


# ---- a custom policy's decisions, exact block states -------------------------------------


def test_soft_pinned_system_prompt_blocks_are_evicted_last():
    policy = PinSystemPrompt()
    kv = make_kv(9, policy)  # 8 usable blocks
    run_turn(kv, "a", SYSTEM + [50, 51, 52, 53])  # blocks 1, 2 (system) and 3
    [turn] = policy.turns
    assert (turn.request_id, turn.num_tokens, turn.num_full_blocks) == ("a", 12, 3)
    assert not turn.held
    assert turn.block_hashes == tuple(make_request("x", SYSTEM + [50, 51, 52, 53]).block_hashes)
    pool = kv.pool
    assert pool.pinned_queue.get_block_ids() == [2, 1]  # freed tail first
    assert pool.free_queue.get_block_ids() == [4, 5, 6, 7, 8, 3]
    assert [b.soft_pinned for b in pool.blocks[1:4]] == [True, True, False]
    # a cold request needs 7 blocks: the unpinned cached block 3 goes, then pinned block 2
    big = make_request("big", list(range(200, 228)))
    assert kv.allocate_slots(big, 28).get_block_ids() == ([4, 5, 6, 7, 8, 3, 2],)
    assert pool.pinned_queue.get_block_ids() == [1] and pool.free_queue.get_block_ids() == []
    assert not pool.blocks[2].soft_pinned and pool.blocks[2].block_hash != turn.block_hashes[1]
    kv.check_integrity()
    # the pinned first block still hits
    _, num_hit = kv.get_computed_blocks(make_request("b", SYSTEM + [60]))
    assert num_hit == 4
    kv.free(big)
    assert_no_leak(kv)


def test_a_touched_soft_pinned_block_goes_back_to_the_pinned_queue():
    kv = make_kv(9, PinSystemPrompt())
    run_turn(kv, "a", SYSTEM + [50])
    b = run_turn(kv, "b", SYSTEM + [60, 61, 62, 63], end=False)  # hits blocks 1 and 2
    assert kv.get_block_ids("b") == ([1, 2, 3],)
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 1]
    assert kv.pool.pinned_queue.get_block_ids() == []
    kv.finish_turn(b, hold=False)
    assert kv.pool.pinned_queue.get_block_ids() == [2, 1]
    assert kv.pool.free_queue.get_block_ids() == [4, 5, 6, 7, 8, 3]
    assert_no_leak(kv)


def test_custom_eviction_order_releases_the_largest_held_kv_first():
    kv = make_kv(11, PinSystemPrompt())  # 10 usable blocks
    run_turn(kv, "small", list(range(20, 25)), hold=True)  # 5 tokens -> 2 blocks
    run_turn(kv, "large", list(range(40, 53)), hold=True)  # 13 tokens -> 4 blocks
    run_turn(kv, "mid", list(range(60, 69)), hold=True)  # 9 tokens -> 3 blocks
    assert kv.num_free_blocks == 1
    r = make_request("r", list(range(80, 88)))  # needs 2 blocks: 1 free, "large" goes first
    assert kv.allocate_slots(r, 8) is not None
    assert sorted(h.handle for h in kv.held) == ["mid", "small"]
    assert kv.get_block_ids("r") == ([6, 10],)  # 6: the tail of "large" (never cached)
    assert kv.pool.free_queue.get_block_ids() == [5]
    assert kv.pool.pinned_queue.get_block_ids() == [4, 3]  # its soft-pinned first blocks
    kv.check_integrity()
    kv.free(r)
    assert_no_leak(kv)


def test_handles_a_policy_does_not_name_follow_in_the_default_order():
    class OnlyMid(KVPolicy):
        def choose_evictions(self, candidates, num_blocks):
            assert num_blocks == 4  # 4 more blocks needed, none free
            assert [(c.handle, c.num_blocks, c.last_used) for c in candidates] == [
                ("old", 2, 1),
                ("mid", 2, 2),
                ("new", 2, 3),
            ]
            return ["mid"]

    kv = make_kv(7, OnlyMid())  # 6 usable
    for i, rid in enumerate(["old", "mid", "new"]):
        run_turn(kv, rid, list(range(10 * i, 10 * i + 5)), hold=True)
    r = make_request("r", list(range(100, 116)))
    assert kv.allocate_slots(r, 16) is not None
    assert [h.handle for h in kv.held] == ["new"]  # "mid" (named), then "old" (LRU)
    kv.free(r)
    assert_no_leak(kv)


def test_demote_at_turn_end_releases_held_kv_to_the_front_of_the_queue():
    class DemoteAll(KVPolicy):
        def on_turn_end(self, turn):
            return TurnEndDecision(soft_pin_blocks=1, demote=True)

    kv = make_kv(9, DemoteAll())
    run_turn(kv, "t", list(range(10)), hold=True)  # 11 tokens: blocks 1, 2 full + 3 partial
    assert len(kv.held) == 0
    assert kv.pool.pinned_queue.get_block_ids() == [1]
    assert kv.pool.free_queue.get_block_ids() == [2, 3, 4, 5, 6, 7, 8]  # 2 demoted, reused first
    assert kv.pool.blocks[2].block_hash is not None  # demoted, still cached
    assert_no_leak(kv)


def test_checkpoints_where_the_policy_plans_them_else_the_configured_retention():
    class EveryEight(KVPolicy):
        def plan_checkpoints(self, request, block_size):
            if request.request_id.startswith("defer"):
                return None
            return CheckpointPlan(every=8)

    kv = make_kv(40, EveryEight(), specs=(FULL, LINEAR), retention=IntervalRetention(0))
    run_turn(kv, "a", list(range(17)))
    b = make_request("b", list(range(17)) + [9])
    assert kv.get_computed_blocks(b)[1] == 16
    kv2 = make_kv(40, EveryEight(), specs=(FULL, LINEAR), retention=IntervalRetention(0))
    run_turn(kv2, "defer-a", list(range(17)))  # rolling: only the latest boundary, 16
    for length, expected in ((17, 16), (13, 0)):
        hit = kv2.get_computed_blocks(make_request("c", list(range(length)) + [9]))[1]
        assert hit == expected
    assert_no_leak(kv)
    assert_no_leak(kv2)


def test_the_built_in_retention_policies_are_kv_policies():
    for policy in (IntervalRetention(8), MarconiRetention()):
        assert isinstance(policy, KVPolicy)
        assert policy.on_turn_end(None) == TurnEndDecision()
    kv = make_kv(40, None, specs=(FULL, LINEAR), retention=IntervalRetention(8))
    assert kv.policy.policy is kv.policy.retention


# ---- tool waits (the offload manager asks the policy) -------------------------------------


class FakePages:
    page_bytes = 16

    def gather_pages(self, block_ids):
        return torch.zeros((len(block_ids), self.page_bytes), dtype=torch.uint8)

    def scatter_pages(self, block_ids, pages):
        pass


def make_offload(policy, errors="raise"):
    kv = make_kv(9, policy, errors)
    config = OffloadConfig(host_bytes=64 * FakePages.page_bytes, prefetch_margin_s=0.5)

    store = build_tiered_store(FakePages.page_bytes, "test", host_blocks=64)
    now = [100.0]
    return OffloadManager(store, kv, FakePages(), config, clock=lambda: now[0]), kv, now


def tool_turn(offload, kv, rid, tokens, seconds, hold):
    from agentx.engine.hints import ToolLatency

    r = run_turn(kv, rid, tokens, hold=hold, end=False, hints=(ToolLatency(seconds),))
    offload.on_request(r)
    kv.finish_turn(r, hold=hold)
    offload.after_step()
    return r


def test_tool_wait_decisions_set_demotion_and_the_prefetch_time():
    class Later(KVPolicy):
        def __init__(self):
            self.waits = []

        def on_tool_wait(self, wait):
            self.waits.append(wait)
            return ToolWaitDecision(demote=False, prefetch_in_s=wait.seconds * 0.5)

    policy = Later()
    offload, kv, now = make_offload(policy)
    tool_turn(offload, kv, "h", list(range(8)), 10.0, hold=True)
    [wait] = policy.waits
    assert (wait.request_id, wait.seconds, wait.num_tokens, wait.held) == ("h", 10.0, 8, True)
    assert wait.num_full_blocks == 2 and wait.prefetch_margin_s == 0.5
    assert kv.held.expected_return == {}  # not demoted
    assert offload.tool_waits["h"].prefetch_at == 105.0
    default_offload, default_kv, _ = make_offload(None)
    tool_turn(default_offload, default_kv, "h", list(range(8)), 10.0, hold=True)
    assert default_kv.held.expected_return == {"h": 110.0}
    assert default_offload.tool_waits["h"].prefetch_at == 109.5
    for o in (offload, default_offload):
        o.flush()
        o.close()


# ---- misbehaving policies ----------------------------------------------------------------


class Raises(KVPolicy):
    name = "raises"

    def plan_checkpoints(self, request, block_size):
        raise RuntimeError("plan bug")

    def on_turn_end(self, turn):
        raise RuntimeError("turn bug")

    def choose_evictions(self, candidates, num_blocks):
        raise RuntimeError("evict bug")

    def on_tool_wait(self, wait):
        raise RuntimeError("tool bug")


def answering(**answers):
    class Nonsense(KVPolicy):
        name = "nonsense"

    for hook, answer in answers.items():
        setattr(Nonsense, hook, lambda self, *args, _a=answer: _a)
    return Nonsense()


BAD_TURN_ENDS = [
    (TurnEndDecision(soft_pin_blocks=99), "soft_pin_blocks=99: the turn has 3 full blocks"),
    (TurnEndDecision(soft_pin_blocks=-1), "soft_pin_blocks=-1"),
    (TurnEndDecision(soft_pin_blocks=True), "soft_pin_blocks=True"),
    (TurnEndDecision(demote="yes"), "demote='yes'"),
    ([1, 2], r"returned \[1, 2\], expected a TurnEndDecision"),
    (None, "expected a TurnEndDecision"),
]


@pytest.mark.parametrize("answer, message", BAD_TURN_ENDS)
def test_an_invalid_turn_end_is_refused_and_the_cache_is_untouched(answer, message):
    kv = make_kv(9, answering(on_turn_end=answer))
    r = run_turn(kv, "a", SYSTEM + [50, 51, 52, 53], hold=True, end=False)
    before = [(b.block_id, b.ref_cnt, b.block_hash) for b in kv.pool.blocks]
    with pytest.raises(KVPolicyError, match=message) as info:
        kv.finish_turn(r, hold=True)
    assert info.value.policy == "nonsense" and info.value.hook == "on_turn_end"
    assert [(b.block_id, b.ref_cnt, b.block_hash) for b in kv.pool.blocks] == before
    assert kv.get_block_ids("a") == ([1, 2, 3],) and len(kv.held) == 0
    kv.check_integrity()
    kv.free(r)  # the caller still owns the request's blocks: nothing leaked
    assert_no_leak(kv)


BAD_EVICTIONS = [
    (["ghost"], r"\['ghost'\]: not among the candidates"),
    (["a", "a"], "a handle twice"),
    ([3], r"\[3\]: not among"),
    ("a", "expected a list of candidate handles"),
    (None, "expected a list"),
]


@pytest.mark.parametrize("answer, message", BAD_EVICTIONS)
def test_invalid_eviction_choices_are_refused_before_anything_is_released(answer, message):
    kv = make_kv(7, answering(choose_evictions=answer))
    run_turn(kv, "a", list(range(5)), hold=True)
    run_turn(kv, "b", list(range(10, 15)), hold=True)
    big = make_request("big", list(range(100, 112)))  # 3 blocks, 2 free
    with pytest.raises(KVPolicyError, match=message):
        kv.allocate_slots(big, 12)
    assert sorted(h.handle for h in kv.held) == ["a", "b"] and kv.num_free_blocks == 2
    assert kv.get_block_ids("big") == ([],)
    kv.check_integrity()
    assert_no_leak(kv)


BAD_PLANS = [
    (CheckpointPlan(fixed=frozenset({3})), "positive multiples of the block size 4"),
    (CheckpointPlan(fixed=frozenset({-4})), "positive multiples"),
    (CheckpointPlan(every=6), "every=6"),
    (CheckpointPlan(rolling=1), "rolling=1"),
    ({8}, "expected a CheckpointPlan or None"),
]


@pytest.mark.parametrize("answer, message", BAD_PLANS)
def test_invalid_checkpoint_plans_are_refused_before_any_block_is_allocated(answer, message):
    kv = make_kv(40, answering(plan_checkpoints=answer), specs=(FULL, LINEAR))
    r = make_request("a", list(range(17)))
    with pytest.raises(KVPolicyError, match=message):
        kv.allocate_slots(r, 17, 0, kv.get_computed_blocks(r)[0])
    assert kv.get_num_used_blocks() == 0 and kv.stats.num_queries == 0
    kv.check_integrity()
    assert_no_leak(kv)


BAD_TOOL_WAITS = [
    (ToolWaitDecision(prefetch_in_s=math.nan), "prefetch_in_s=nan"),
    (ToolWaitDecision(prefetch_in_s=-1.0), "prefetch_in_s=-1.0"),
    (ToolWaitDecision(prefetch_in_s="soon"), "prefetch_in_s='soon'"),
    (ToolWaitDecision(demote=None), "demote=None"),
    (True, "expected a ToolWaitDecision"),
]


@pytest.mark.parametrize("answer, message", BAD_TOOL_WAITS)
def test_invalid_tool_wait_decisions_are_refused(answer, message):
    offload, kv, _ = make_offload(answering(on_tool_wait=answer))
    with pytest.raises(KVPolicyError, match=message):
        tool_turn(offload, kv, "h", list(range(8)), 10.0, hold=True)
    assert offload.tool_waits == {} and kv.held.expected_return == {}
    kv.check_integrity()
    offload.flush()
    offload.check_integrity()
    offload.close()
    assert_no_leak(kv)


def test_a_raising_policy_in_fallback_mode_gets_the_built_in_decisions():
    """Every hook raises; the cache ends exactly as under the default policy, errors counted."""
    states = []
    for policy in (Raises(), None):
        offload, kv, _ = make_offload(policy, errors="fallback")
        tool_turn(offload, kv, "h", list(range(8)), 10.0, hold=True)
        run_turn(kv, "a", list(range(20, 25)), hold=True)
        big = make_request("big", list(range(100, 124)))  # 6 blocks: 4 free, "h" goes first
        assert kv.allocate_slots(big, 24) is not None
        states.append(
            (
                [h.handle for h in kv.held],
                kv.pool.free_queue.get_block_ids(),
                kv.pool.pinned_queue.get_block_ids(),
                [b.ref_cnt for b in kv.pool.blocks],
                dict(kv.held.expected_return),
                {h: w.prefetch_at for h, w in offload.tool_waits.items()},
            )
        )
        kv.check_integrity()
        if policy is not None:
            errors = kv.policy.take_errors()
            hooks = ["on_turn_end", "on_tool_wait", "on_turn_end", "choose_evictions"]
            assert [e.hook for e in errors] == hooks and kv.policy.num_errors == 4
            message = "KV policy 'raises': on_tool_wait raised RuntimeError: tool bug"
            assert str(errors[1]) == message
            assert isinstance(errors[1].__cause__, RuntimeError)
        kv.free(big)
        offload.flush()
        offload.close()
        assert_no_leak(kv)
    assert states[0] == states[1]
    assert states[0][0] == ["a"]


def test_config_takes_a_policy_or_a_factory_and_refuses_anything_else():
    assert CacheConfig(kv_policy=PinSystemPrompt).kv_policy is PinSystemPrompt
    policy = PinSystemPrompt()
    assert CacheConfig(kv_policy=policy).kv_policy is policy
    with pytest.raises(ConfigError, match="kv_policy must be a KVPolicy"):
        CacheConfig(kv_policy="lru")
    with pytest.raises(ConfigError, match="kv_policy_errors must be one of"):
        CacheConfig(kv_policy_errors="ignore")


# ---- through the engine (the real default model) -----------------------------------------


class PinFirstBlock(KVPolicy):
    def on_turn_end(self, turn):
        return TurnEndDecision(soft_pin_blocks=min(1, turn.num_full_blocks))


@pytest.mark.slow
def test_the_engine_applies_a_configured_policy_and_survives_a_broken_one(make_engine):
    from agentx import SamplingParams

    prompt = list(range(1, 40))  # 39 tokens: 2 full blocks of 16
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = make_engine(cache=CacheConfig(num_blocks=32, kv_policy=PinFirstBlock))
    expected = engine.generate([prompt], greedy)[0].token_ids
    assert engine.core.kv.pool.pinned_queue.get_block_ids() == [1]
    engine.check_integrity()
    broken = make_engine(cache=CacheConfig(num_blocks=32, kv_policy=Raises()))
    assert broken.generate([prompt], greedy)[0].token_ids == expected
    stats = broken.stats()
    assert stats.kv_policy_errors == 1 and stats.kv_num_used_blocks == 0
    assert broken.core.kv.pool.pinned_queue.get_block_ids() == []
    broken.check_integrity()


@pytest.mark.slow
def test_raise_mode_stops_the_engine_with_the_policy_error(make_engine):
    from agentx import EngineDeadError, SamplingParams

    cache = CacheConfig(num_blocks=32, kv_policy=Raises(), kv_policy_errors="raise")
    engine = make_engine(cache=cache)
    with pytest.raises(EngineDeadError) as info:
        engine.generate([list(range(1, 40))], SamplingParams(max_tokens=2))
    assert isinstance(info.value.__cause__, KVPolicyError)
    assert info.value.__cause__.hook == "on_turn_end"
