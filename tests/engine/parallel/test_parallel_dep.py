"""Data-parallel attention beside expert parallel (DEP: ``ParallelConfig(ep=2,
dp_attention=True)``) over worker processes (gloo on loopback), on the tiny random Qwen3-Next of
test_parallel_ep.py (6 experts, top 4, a shared expert; Gated DeltaNet and gated attention).

Each request runs on one rank (its attention, linear state, KV, LM head); each MoE layer sends
a rank's tokens to the ranks of their experts and back. The placement is checked without
processes (``AttentionRankManager``), the two dispatches against one process computing every
expert on the same rows (bit for bit), and the engine's greedy tokens against ep=1 with a batch
that lands on both ranks, prefix hits and preemption. Every process runs one torch thread. A
worker killed mid-step gives EngineDeadError and leaves no process behind.
"""

import socket
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp

from agentx import (
    CacheConfig,
    ConfigError,
    Engine,
    EngineConfig,
    ParallelConfig,
    SamplingParams,
    SchedulerConfig,
    env,
)
from agentx.engine.executors.dep import ALL_RANKS, AttentionRankManager
from agentx.engine.executors.worker import WorkerCall
from agentx.engine.kv_cache import BlockCopy
from agentx.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from agentx.engine.parallel.moe_dispatch import dispatch_all_gather, dispatch_all_to_all
from agentx.kernels.ref import moe_expert_slots, topk_softmax
from tests.helpers.models import random_tokens, save_qwen3_next_folder, tiny_qwen3_next
from tests.helpers.parallel import assert_no_process_left, kill_rank_mid_generation

NUM_BLOCKS = 16  # four ~100-token requests sharing 4 prefix blocks do not fit: preemption
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SHARED = random_tokens(64, seed=1)  # 4 full blocks
PROMPTS = [SHARED + random_tokens(30 + 3 * i, seed=10 + i) for i in range(4)]
ALONE = [random_tokens(10 + 5 * i, seed=40 + i) for i in range(4)]  # no shared prefix, fits


# ---- config ------------------------------------------------------------------------------


def test_dep_config():
    dep = ParallelConfig(ep=2, dp_attention=True)
    assert dep.world_size == 2 and dep.moe_dispatch == "all_to_all"
    assert ParallelConfig(ep=2, dp_attention=True, moe_dispatch="all_gather").world_size == 2
    bad = (
        {"dp_attention": True},  # no expert-parallel ranks to run on
        {"ep": 2, "dp_attention": 1},
        {"ep": 2, "dp_attention": True, "moe_dispatch": "broadcast"},
        {"ep": 2, "moe_dispatch": "all_gather"},  # a dispatch without dp_attention
        {"ep": 2, "dp_attention": True, "tp": 2},
        {"ep": 2, "dp_attention": True, "dcp": 2},
    )
    for kw in bad:
        with pytest.raises(ConfigError):
            ParallelConfig(**kw)


# ---- placement (no processes) ------------------------------------------------------------


def _item(rid: str, blocks: list[int], start: int = 0, is_new: bool = True, n: int = 1):
    return ScheduledRequest(
        request_id=rid,
        token_ids=[5] * n,
        start_position=start,
        new_block_ids=(blocks,),
        is_new=is_new,
        sample=True,
        sampling=GREEDY,
        seed=0,
        num_output_tokens=0,
    )


def _step(*items: ScheduledRequest, finished: frozenset[str] = frozenset()) -> SchedulerOutput:
    return SchedulerOutput(list(items), sum(len(it.token_ids) for it in items), finished)


def _ids(parts: list[SchedulerOutput]) -> list[list[str]]:
    return [[it.request_id for it in part.scheduled] for part in parts]


def test_new_requests_go_to_the_least_loaded_rank_and_stay():
    dep = AttentionRankManager(2, block_size=16)
    parts = dep.split(_step(*(_item(f"r{i}", [i + 1], n=20) for i in range(3))))
    assert _ids(parts) == [["r0", "r2"], ["r1"]]
    assert [p.num_scheduled_tokens for p in parts] == [40, 20]
    assert dep.num_requests == [2, 1]
    assert dep.block_owner == {1: 0, 2: 1, 3: 0}
    # running requests stay; r3 fills rank 1; r0 ends, so r4 goes to rank 0
    running = (_item("r1", [], 20, False), _item("r3", [7]), _item("r2", [9], 20, False))
    parts = dep.split(_step(*running))
    assert _ids(parts) == [["r2"], ["r1", "r3"]]
    assert dep.block_owner[9] == 0 and dep.block_owner[7] == 1
    parts = dep.split(_step(_item("r4", [11]), finished=frozenset({"r0"})))
    assert _ids(parts) == [["r4"], []]
    assert all(p.finished_request_ids == {"r0"} for p in parts)
    dep.check_integrity([{"r2", "r4"}, {"r1", "r3"}])
    with pytest.raises(AssertionError):
        dep.check_integrity([{"r1"}, set()])
    with pytest.raises(RuntimeError):
        dep.split(_step(_item("never-placed", [], 3, False)))


def test_a_prefix_hit_runs_where_its_blocks_are():
    dep = AttentionRankManager(2, block_size=16)
    dep.split(_step(_item("a", [1, 2, 3]), _item("b", [4, 5])))  # a on 0, b on 1
    dep.forget(frozenset({"a", "b"}))  # both ended; their blocks stay cached
    assert dep.num_requests == [0, 0]
    # c hits a's first two blocks (32 tokens): rank 0, though both ranks are empty
    parts = dep.split(_step(_item("d", [4, 8], start=16), _item("c", [1, 2, 6], start=32)))
    assert _ids(parts) == [["c"], ["d"]]
    # a hit on the null block (a linear group's entry) or on pages every rank holds: no pull
    dep.mark_everywhere([12, 13])
    parts = dep.split(_step(_item("e", [0, 12, 13, 14], start=40)))
    assert _ids(parts) == [["e"], []]  # the least loaded (tie: 1 request each, rank 0)
    assert dep.owner_of(12) == 0 and dep.owner_of(99) == ALL_RANKS
    dep.copy_blocks([BlockCopy(src_block_id=5, dst_block_id=20)])
    assert dep.owner_of(20) == 1


def test_a_hit_chain_on_two_ranks_is_copied_to_the_chosen_one():
    """a and b compute the same first block in one step (a on 0, b on 1); the cache keeps a's
    block 1 and chains b's block 4 after it. c hits both: it runs on rank 1 (the deepest hit
    block's), and block 1 is copied there from rank 0 first."""
    dep = AttentionRankManager(2, block_size=16)
    dep.split(_step(_item("a", [1, 2]), _item("b", [3, 4])))
    assert dep.take_copies() == []
    parts = dep.split(_step(_item("c", [1, 4, 5], start=32)))
    assert _ids(parts) == [[], ["c"]]
    assert dep.take_copies() == [(1, 0, 1)]
    assert dep.take_copies() == [] and dep.owner_of(1) == 1


def test_a_preempted_request_that_moves_leaves_its_old_rank():
    dep = AttentionRankManager(2, block_size=16)
    dep.split(_step(_item("a", [1]), _item("b", [2]), _item("c", [3])))  # a, c on 0; b on 1
    # b ends; c preempted and back with no hit: rank 1 is empty, rank 0 drops c's row
    parts = dep.split(_step(_item("c", [4], start=0), finished=frozenset({"b"})))
    assert _ids(parts) == [[], ["c"]]
    assert parts[0].finished_request_ids == {"b", "c"} and parts[1].finished_request_ids == {"b"}
    assert dep.num_requests == [1, 1]
    # g hits a's block: rank 0, though rank 1 runs fewer requests
    dep.split(_step(_item("d", [6])))  # rank 0: a, d; rank 1: c
    parts = dep.split(_step(_item("g", [1, 5], start=16)))
    assert _ids(parts) == [["g"], []]
    assert all(not p.finished_request_ids for p in parts)
    assert dep.num_requests == [3, 1]


def test_masks_and_outputs_by_rank():
    dep = AttentionRankManager(2, block_size=16)
    dep.split(_step(_item("a", [1]), _item("b", [2]), _item("c", [3])))
    bitmask = torch.arange(8, dtype=torch.int32).view(4, 2)
    parts = dep.split_masks((["a", "b", "b", "c"], bitmask))
    assert parts[0][0] == ["a", "c"] and torch.equal(parts[0][1], bitmask[[0, 3]])
    assert parts[1][0] == ["b", "b"] and torch.equal(parts[1][1], bitmask[[1, 2]])
    assert dep.split_masks((["a"], bitmask[:1]))[1] is None
    merged = AttentionRankManager.merge(
        [ModelRunnerOutput({"a": 4}, {"a": [5]}), ModelRunnerOutput({"b": 7})]
    )
    assert merged.sampled_token_ids == {"a": 4, "b": 7}
    assert merged.extra_token_ids == {"a": [5]}


# ---- the dispatches, two gloo processes -------------------------------------------------

NUM_EXPERTS, HIDDEN, INTER, TOP_K = 6, 64, 32, 4
TOKENS_PER_RANK = {"both": (7, 12), "one idle": (0, 9), "decode": (1, 1)}


def _routing(num_tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=generator)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=generator)
    weights, ids = topk_softmax(logits, TOP_K, True)
    return x, weights, ids


def _experts():
    generator = torch.Generator().manual_seed(99)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=generator) * 0.2
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=generator) * 0.2
    return w13, w2


def _dispatch_rank(rank: int, port: int, sizes: tuple[int, int], how: str, queue) -> None:
    torch.set_num_threads(1)
    env.pin_gloo_to_loopback()
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    try:
        w13, w2 = _experts()
        num_local = NUM_EXPERTS // 2
        start = rank * num_local
        mine = (w13[start : start + num_local], w2[start : start + num_local])

        def local(x, w, ids):
            return moe_expert_slots(x, *mine, w, ids, start)

        x, weights, ids = _routing(sizes[rank], seed=rank)
        if how == "all_to_all":
            slots = dispatch_all_to_all(x, weights, ids, num_local, local)
        else:
            slots = dispatch_all_gather(x, weights, ids, rank, local)
        queue.put((rank, slots))
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["all_to_all", "all_gather"])
@pytest.mark.parametrize("case", list(TOKENS_PER_RANK))
def test_dispatch_gives_each_rank_its_slots_bit_for_bit(how, case):
    """Each rank gets its tokens' slots as one process computing every expert over both ranks'
    rows (rank 0's, then rank 1's: the order an expert sees them in) gives them."""
    sizes = TOKENS_PER_RANK[case]
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    procs = [
        context.Process(target=_dispatch_rank, args=(r, port, sizes, how, queue)) for r in (0, 1)
    ]
    for proc in procs:
        proc.start()
    got = dict(queue.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    inputs = [_routing(n, seed=r) for r, n in enumerate(sizes)]
    x, weights, ids = (torch.cat(parts) for parts in zip(*inputs, strict=True))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: a GEMM's float order depends on its threads
    try:
        want = moe_expert_slots(x, *_experts(), weights, ids, 0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[0], want[: sizes[0]])
    assert torch.equal(got[1], want[sizes[0] :])
    assert got[0].shape == (sizes[0], TOP_K, HIDDEN)


# ---- the engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-next-dep")
    save_qwen3_next_folder(path, tiny_qwen3_next(num_experts_per_tok=4))
    return path


def _config(folder, parallel: ParallelConfig, **kw) -> EngineConfig:
    return EngineConfig(
        model=str(folder),
        num_threads=1,
        cache=CacheConfig(num_blocks=kw.pop("num_blocks", NUM_BLOCKS), block_size=16),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=32, long_prefill_token_threshold=16, step_cost_model="fixed"
        ),
        parallel=parallel,
        **kw,
    )


DEP = ParallelConfig(ep=2, dp_attention=True)


def test_dep_refused_before_any_worker(folder):
    with pytest.raises(ConfigError):
        Engine(_config(folder, ParallelConfig(ep=4, dp_attention=True)))  # 4 does not divide 6
    with pytest.raises(ConfigError):
        Engine(replace(_config(folder, DEP), model=None))  # SmolLM2 has no experts


@pytest.fixture(scope="module")
def engines(folder):
    ep1 = Engine(_config(folder, ParallelConfig()))
    dep = Engine(_config(folder, DEP))
    yield ep1, dep
    ep1.close()
    dep.close()


def _rows_per_rank(engine: Engine) -> list[int]:
    return engine.core.runner._call(WorkerCall("get_num_rows_run", gather=True))


@pytest.mark.slow
def test_dep_greedy_equals_ep1_on_both_ranks(engines):
    """Four requests at once, no shared prefix: two on each rank, each rank runs only its own
    rows (together as many as ep=1 runs: the same schedule, the same drafts)."""
    ep1, dep = engines
    one_before = ep1.core.runner.num_rows_run
    want = [g.token_ids for g in ep1.generate(ALONE, GREEDY)]
    num_rows = ep1.core.runner.num_rows_run - one_before
    before = _rows_per_rank(dep)
    assert [g.token_ids for g in dep.generate(ALONE, GREEDY)] == want
    ran = [after - b for after, b in zip(_rows_per_rank(dep), before, strict=True)]
    assert sum(ran) == num_rows
    assert min(ran) >= sum(len(p) for p in ALONE[:2])  # the shorter pair's prompts at least
    dep.check_integrity()


@pytest.mark.slow
def test_dep_greedy_with_prefix_hits_and_preemption(engines):
    ep1, dep = engines
    want = [g.token_ids for g in ep1.generate(PROMPTS[:3], GREEDY)]
    assert [g.token_ids for g in dep.generate(PROMPTS[:3], GREEDY)] == want
    again = dep.generate(PROMPTS[:3], GREEDY)  # the shared prefix from the cache
    assert [g.token_ids for g in again] == want
    assert min(g.usage.cached_tokens for g in again) >= 64
    want = [g.token_ids for g in ep1.generate(PROMPTS, GREEDY)]
    before = dep.stats().num_preemptions
    assert [g.token_ids for g in dep.generate(PROMPTS, GREEDY)] == want
    assert dep.stats().num_preemptions > before
    assert dep.stats().kv_num_used_blocks == 0
    dep.check_integrity()


@pytest.mark.slow
def test_dep_offload_pages_come_from_their_rank(engines):
    """A block's page is read from the rank that wrote it and written back to every rank."""
    ep1, dep = engines
    runner = dep.core.runner
    assert runner.page_bytes == ep1.core.runner.page_bytes
    dep.generate(ALONE[:2], GREEDY)  # ALONE[0] on rank 0, ALONE[1] on rank 1
    owned = sorted(runner._dep.block_owner.items())
    on_0 = next(b for b, r in owned if r == 0)
    on_1 = next(b for b, r in owned if r == 1)
    with dep._step_lock:
        per_rank = runner._call(WorkerCall("gather_pages", ([on_0, on_1],), gather=True))
        pages = runner.gather_pages([on_0, on_1])
        assert torch.equal(pages[0], per_rank[0][0]) and torch.equal(pages[1], per_rank[1][1])
        assert not torch.equal(per_rank[0][1], per_rank[1][1])  # rank 0 never wrote on_1
        runner.scatter_pages([on_0, on_1], pages)
        assert runner._dep.owner_of(on_0) == runner._dep.owner_of(on_1) == ALL_RANKS
        per_rank = runner._call(WorkerCall("gather_pages", ([on_0, on_1],), gather=True))
        assert torch.equal(per_rank[0], pages) and torch.equal(per_rank[1], pages)


@pytest.mark.slow
def test_dep_all_gather_dispatch_equals_ep1(folder, engines):
    ep1, _ = engines
    want = [g.token_ids for g in ep1.generate(ALONE[:3], GREEDY)]
    parallel = replace(DEP, moe_dispatch="all_gather")
    engine = Engine(_config(folder, parallel))
    try:
        assert [g.token_ids for g in engine.generate(ALONE[:3], GREEDY)] == want
        engine.check_integrity()
    finally:
        engine.close()


@pytest.mark.slow
def test_dep_dead_worker(folder):
    prompt = random_tokens(40, seed=3)
    engine = Engine(_config(folder, DEP, num_blocks=64))
    try:
        pids = kill_rank_mid_generation(engine, 1, prompt, 400, GREEDY)
    finally:
        engine.close()
    assert_no_process_left(pids)
