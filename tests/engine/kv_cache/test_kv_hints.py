"""Hints that act on held KV: ``BranchPoint(n)`` holds a fork point (and its forks, until they
start) against pressure; ``TurnsLeft(k)`` releases the sessions about to end first. Exact
state: which handle goes first, reference counts, ``check_integrity()`` after each step."""

from agentx import SamplingParams, Session
from agentx.engine.hints import BranchPoint, TurnsLeft
from agentx.engine.kv_cache.policy import HeldCandidate, default_eviction_order
from tests.helpers.kv import assert_no_leak, make_kv, make_request, run_turn


def test_default_order_releases_fewer_turns_left_first_then_least_recent():
    def cand(handle, last_used, turns_left=None, expected_return=None):
        return HeldCandidate(handle, 8, 2, last_used, expected_return, turns_left)

    order = default_eviction_order(
        [cand("old", 1), cand("many", 2, 30), cand("last", 4, 0), cand("few", 3, 2),
         cand("last-older", 0, 0), cand("tool", 5, 30, expected_return=9.0)]
    )  # fmt: skip
    # a tool wait (expected back last) first; then by turns left; not hinted is last
    assert order == ["tool", "last-older", "last", "few", "many", "old"]


def test_the_session_on_its_last_turn_is_released_before_older_held_kv():
    kv = make_kv(9)  # 8 usable blocks
    run_turn(kv, "old", list(range(0, 5)), hold=True)  # 2 blocks each
    run_turn(kv, "long", list(range(10, 15)), hold=True, hints=(TurnsLeft(30),))
    run_turn(kv, "ending", list(range(20, 25)), hold=True, hints=(TurnsLeft(0),))
    assert [(h.handle, h.turns_left) for h in kv.held] == [
        ("old", None), ("long", 30), ("ending", 0)
    ]  # fmt: skip
    assert kv.num_free_blocks == 2
    r = make_request("r", list(range(100, 116)))  # 4 blocks: 2 more than free
    assert kv.allocate_slots(r, 16) is not None
    assert [h.handle for h in kv.held] == ["old", "long"]  # the newest, but on its last turn
    kv.check_integrity()
    r2 = make_request("r2", list(range(200, 208)))  # 2 more: "long" (30 turns) before "old"
    assert kv.allocate_slots(r2, 8) is not None
    assert [h.handle for h in kv.held] == ["old"]
    kv.check_integrity()
    kv.free(r)
    kv.free(r2)
    assert_no_leak(kv)


def test_a_branch_point_is_held_until_its_forks_were_made_and_the_forks_until_they_start():
    kv = make_kv(13)  # 12 usable blocks
    run_turn(kv, "other", list(range(50, 59)), hold=True)  # 9 tokens: 2 full blocks + a tail
    parent = run_turn(kv, "p", list(range(9)), hold=True, hints=(BranchPoint(2),))
    held = kv.get_held("p")
    assert (held.forks_left, held.fork_pending, held.num_tokens) == (2, False, 9)
    assert [c.handle for c in kv.held.get_candidates()] == ["other"]
    shared = [b.block_id for b in held.blocks[0]]
    assert shared == [4, 5, 6]

    # pressure: only "other" may go, the branch point stays whole
    big = make_request("big", list(range(100, 124)))  # 6 blocks, 6 free
    assert kv.allocate_slots(big, 24) is not None
    assert [h.handle for h in kv.held] == ["other", "p"]  # no room needed yet
    kv.check_integrity()
    filler = make_request("filler", list(range(300, 304)))  # 1 block: none free
    assert kv.allocate_slots(filler, 4) is not None
    assert [h.handle for h in kv.held] == ["p"]  # "other" released, not the branch point
    kv.check_integrity()

    # the first fork: counts against the branch, held until it starts
    assert kv.fork_held("p", ["p/0"]) is not None  # tail copy: one block from "other"'s room
    assert (kv.get_held("p").forks_left, kv.get_held("p/0").fork_pending) == (1, True)
    assert [kv.pool.blocks[i].ref_cnt for i in shared[:2]] == [2, 2]  # full blocks shared
    assert kv.held.get_candidates() == []
    assert kv.fork_held("p", ["p/1"]) is not None
    assert (kv.get_held("p").forks_left, kv.get_held("p/1").fork_pending) == (0, True)
    assert [kv.pool.blocks[i].ref_cnt for i in shared[:2]] == [3, 3]
    assert [c.handle for c in kv.held.get_candidates()] == ["p"]  # done waiting: plain held KV
    kv.check_integrity()

    # a fork's first turn adopts its hold; the other fork is still kept
    kv.free(big)
    child = run_turn(kv, "c0", list(range(9)) + [7, 7], hold=False, end=False, held_kv="p/0")
    assert "p/0" not in kv.held and kv.get_block_ids("c0")[0][:2] == shared[:2]
    assert [c.handle for c in kv.held.get_candidates()] == ["p"]
    kv.check_integrity()
    kv.free(child)
    kv.free(filler)
    del parent
    assert_no_leak(kv)


def test_without_a_branch_point_the_fork_point_is_released_under_pressure():
    kv = make_kv(9)
    run_turn(kv, "p", list(range(9)), hold=True)  # 3 blocks: 1, 2 and the tail 3
    assert kv.fork_held("p", ["p/0"]) is not None  # 1 tail copy: block 4
    assert [c.handle for c in kv.held.get_candidates()] == ["p", "p/0"]
    r = make_request("r", list(range(100, 120)))  # 5 blocks: 4 free
    assert kv.allocate_slots(r, 20) is not None
    assert [h.handle for h in kv.held] == ["p/0"]  # the fork point went first (oldest)
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2)] == [1, 1]  # the fork alone holds them
    kv.check_integrity()
    kv.free(r)
    assert_no_leak(kv)


async def test_a_session_branch_point_holds_its_forks_until_their_first_turns(make_engine):
    engine = make_engine()
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    async with Session(engine, sampling=sampling) as s:
        s.hint(BranchPoint(2), TurnsLeft(3))
        await s.send("Plan two subtasks.")
        kv = engine.core.kv
        [parent] = list(kv.held)
        assert (parent.forks_left, parent.turns_left) == (2, 3)
        children = await s.fork(2)
        assert kv.get_held(parent.handle).forks_left == 0
        pending = {h.handle for h in kv.held if h.fork_pending}
        assert pending == {c._held_kv for c in children} and len(pending) == 2
        assert {c.handle for c in kv.held.get_candidates()} == {parent.handle}
        reply = await children[0].send("Do the first.")
        assert reply.usage.cached_tokens > 0
        assert {h.handle for h in kv.held if h.fork_pending} == {children[1]._held_kv}
        engine.check_integrity()
        for child in children:
            await child.close()
