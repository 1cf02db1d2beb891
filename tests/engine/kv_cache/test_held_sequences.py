"""Exact-state tests of held KV: a finished turn's KV kept whole (partial tail block
included) for the turn that extends it, copy-on-write forks, reclaim under pressure, pinning."""

from agentx.config import SchedulerConfig
from agentx.engine.kv_cache import BlockCopy
from agentx.engine.outputs import ModelRunnerOutput
from agentx.engine.request import RequestStatus
from agentx.engine.scheduler import Scheduler
from tests.helpers.kv import make_manager, make_request


def finish_turn(kv, rid, tokens, output=(100, 101)):
    """Run a request's prompt and outputs through the KV manager and hold it."""
    r = make_request(rid, tokens, hold_kv=True)
    hit, n = kv.get_computed_blocks(r)
    kv.allocate_slots(r, len(tokens) - n, n, hit)
    r.num_computed_tokens = len(tokens)
    for t in output:  # each sampled token is computed by the next step, except the last
        r.append_output_token(t)
    for _ in output[:-1]:
        kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    r.status = RequestStatus.FINISHED_STOPPED
    kv.hold(r)
    return r


def test_hold_keeps_the_partial_tail_and_the_next_turn_resumes_exactly():
    kv = make_manager(16)
    a = finish_turn(kv, "t1", list(range(9)))  # 9 prompt + 100 computed; 101 sampled, not computed
    held = kv.held.get("t1")
    assert held.token_ids == list(range(9)) + [100]
    assert [b.block_id for b in held.blocks[0]] == [1, 2, 3]  # 10 tokens: 2 full + 1 partial
    kv.check_integrity()
    nxt = make_request("t2", a.all_token_ids + [7, 8, 9], held_kv="t1")
    hit, n = kv.get_computed_blocks(nxt)
    assert n == 10 and hit.get_block_ids() == ([1, 2, 3],) and hit.held_kv == "t1"
    kv.allocate_slots(nxt, nxt.num_tokens - n, n, hit)
    assert "t1" not in kv.held
    assert kv.get_block_ids("t2") == ([1, 2, 3, 4],)  # 14 tokens: the partial block is reused
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 1, 1]
    kv.check_integrity()


def test_prefix_cache_alone_would_recompute_the_partial_block():
    kv = make_manager(16)
    a = finish_turn(kv, "t1", list(range(9)))
    kv.release_held("t1")
    nxt = make_request("t2", a.all_token_ids + [7, 8, 9])
    _, n = kv.get_computed_blocks(nxt)
    assert n == 8  # two full blocks; tokens 8..9 must be recomputed
    assert kv.get_num_used_blocks() == 0
    kv.check_integrity()


def test_a_mismatched_extends_takes_the_prefix_cache_path():
    kv = make_manager(16)
    finish_turn(kv, "t1", list(range(9)))
    other = make_request("x", list(range(8)) + [55, 56], held_kv="t1")
    hit, n = kv.get_computed_blocks(other)
    assert n == 8 and hit.held_kv is None


def test_fork_shares_full_blocks_and_copies_the_tail():
    kv = make_manager(16)
    finish_turn(kv, "p", list(range(9)))  # blocks 1 2 (full) 3 (partial: 2 tokens)
    copies = kv.fork_held("p", ["c0", "c1"])
    assert copies == [BlockCopy(3, 4), BlockCopy(3, 5)]
    assert [b.block_id for b in kv.held.get("c0").blocks[0]] == [1, 2, 4]
    assert [b.block_id for b in kv.held.get("c1").blocks[0]] == [1, 2, 5]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [3, 3, 1, 1, 1]
    kv.check_integrity()
    child = make_request("c0-turn", list(range(9)) + [100, 42], held_kv="c0")
    hit, n = kv.get_computed_blocks(child)
    assert n == 10 and hit.get_block_ids() == ([1, 2, 4],)
    kv.allocate_slots(child, 1, n, hit)
    kv.check_integrity()
    for handle in ("p", "c1"):
        kv.release_held(handle)
    kv.free(child)
    assert kv.get_num_used_blocks() == 0
    kv.check_integrity()


def test_fork_of_block_aligned_sequence_copies_nothing():
    kv = make_manager(16)
    finish_turn(kv, "p", list(range(7)))  # 8 computed tokens: two full blocks
    assert kv.fork_held("p", ["c"]) == []
    assert kv.pool.blocks[1].ref_cnt == 2
    kv.check_integrity()


def test_unpinned_held_kv_is_reclaimed_oldest_first_pinned_never():
    kv = make_manager(9)  # 8 usable blocks
    finish_turn(kv, "old", list(range(6)))  # 7 tokens -> 2 blocks
    finish_turn(kv, "pinned", list(range(20, 26)))  # 2 blocks
    finish_turn(kv, "new", list(range(40, 46)))  # 2 blocks
    assert kv.pin_held("pinned")
    big = make_request("big", list(range(60, 72)))  # 12 tokens -> 3 blocks; 2 are free
    assert kv.allocate_slots(big, 12) is not None
    assert "old" not in kv.held and "pinned" in kv.held and "new" in kv.held
    huge = make_request("huge", list(range(80, 96)))  # 4 blocks: "new" goes, still one short
    assert kv.allocate_slots(huge, 16) is None
    assert "new" not in kv.held and "pinned" in kv.held
    kv.check_integrity()


def test_release_can_drop_the_cached_content():
    kv = make_manager(16)
    r = finish_turn(kv, "t", list(range(9)))
    assert len(kv.pool.cached) == 2
    kv.release_held("t", drop_cached=True)
    assert kv.pool.cached == {} and kv.get_num_used_blocks() == 0
    assert kv.pool.free_queue.get_block_ids()[:3] == [1, 2, 3]
    _, n = kv.get_computed_blocks(make_request("again", r.all_token_ids))
    assert n == 0
    kv.check_integrity()


def test_scheduler_holds_retained_requests_and_schedules_only_the_new_suffix():
    kv = make_manager(32)
    s = Scheduler(SchedulerConfig(), kv, max_model_len=128)
    s.add_request(make_request("turn1", list(range(10)), max_tokens=3, hold_kv=True))
    while s.has_unfinished_requests():
        out = s.schedule()
        sampled = {x.request_id: 200 + x.num_output_tokens for x in out.scheduled if x.sample}
        s.update_from_output(out, ModelRunnerOutput(sampled))
    held = kv.held.get("turn1")
    assert held.token_ids == list(range(10)) + [200, 201]  # 202 was sampled, never computed
    s.check_integrity()
    prompt = list(range(10)) + [200, 201, 202, 7, 7]
    s.add_request(make_request("turn2", prompt, max_tokens=1, held_kv="turn1"))
    out = s.schedule()
    assert out.scheduled[0].token_ids == [202, 7, 7] and out.scheduled[0].start_position == 12
    assert s.requests["turn2"].num_cached_tokens == 12
    assert "turn1" not in kv.held
    s.check_integrity()


def test_the_offload_facade_loads_blocks_behind_a_device_prefix_into_held_kv():
    kv = make_manager(8)  # 7 blocks of 4 tokens
    kv.enable_publish_log()
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    assert [b.block_id for _, b in kv.take_published()] == [1, 2, 3]
    a.num_computed_tokens = 12
    kv.free(a)
    b = make_request("b", list(range(16)) + [99])
    hit = kv.plan_load(b.block_hashes, lambda keys: [True] * len(keys))
    prefix = hit.device_blocks
    assert [blk.block_id for blk in prefix] == [1, 2, 3]
    assert hit.num_blocks == 4 and hit.keys == b.block_hashes[3:4]
    assert kv.get_num_loadable_blocks(prefix) == 4  # 7 free, 3 of them are the prefix
    fresh = kv.prepare_load(prefix, 2)
    assert [blk.block_id for blk in fresh] == [4, 5]
    done = kv.complete_load(fresh, b.block_hashes[3:4], num_done=1)  # the second page failed
    assert [blk.block_id for blk in done] == [4] and kv.take_published() == []
    assert kv.pool.get_cached_block(b.block_hashes[3]).block_id == 4
    groups = kv.take_cached_hit(b.block_hashes)
    kv.free_blocks(prefix + done)
    assert [blk.block_id for blk in groups[0]] == [1, 2, 3, 4]
    kv.add_held("h", list(range(16)), groups)
    assert kv.get_held("h").num_tokens == 16
    assert [blk.ref_cnt for blk in kv.pool.blocks[1:]] == [1, 1, 1, 1, 0, 0, 0]
    kv.check_integrity()
    kv.expect_return("h", 5.0)
    assert kv.held.expected_return == {"h": 5.0}
    kv.release_held("h")
    assert kv.num_free_blocks == 7 and kv.held.expected_return == {}
    kv.check_integrity()
