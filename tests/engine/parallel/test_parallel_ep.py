"""Expert parallel over worker processes (gloo on loopback, world size 2), on a tiny random
Qwen3-Next (6 experts, top 4, a shared expert; Gated DeltaNet and gated attention layers).

Each rank holds 3 of the 6 experts of every MoE layer; attention, the router and the shared expert
are replicated. Top 4, not the usual helper's top 2: with two experts a token no order of
additions can differ, with four a per-rank partial sum already rounds differently (a test below
shows it). The kernel test splits the experts over 2 and 3 "ranks" in one process and checks
that the summed slots combine to :func:`moe_experts`' output bit for bit; the engine test checks
greedy tokens at ep=2 equal ep=1 with prefix caching, chunked prefill and preemption on. Both
engines run one torch thread per process, so a GEMM's own float order is the same in both (what
differs is only what expert parallel changes). A worker killed mid-step gives EngineDeadError
and leaves no process behind.
"""

from dataclasses import replace

import pytest
import torch

from agentx import (
    CacheConfig,
    ConfigError,
    Engine,
    EngineConfig,
    ParallelConfig,
    SamplingParams,
    SchedulerConfig,
)
from agentx.engine.executors.worker import WorkerCall, rank_state
from agentx.engine.models.loader.safetensors import load_hf_folder
from agentx.engine.models.qwen3_next import Qwen3NextForCausalLM
from agentx.engine.parallel import ParallelState
from agentx.kernels.ref import moe_expert_slots, moe_experts, sum_expert_slots, topk_softmax
from tests.helpers.models import random_tokens, save_qwen3_next_folder, tiny_qwen3_next
from tests.helpers.parallel import assert_no_process_left, kill_rank_mid_generation

NUM_BLOCKS = 16  # four ~100-token requests sharing 4 prefix blocks do not fit: preemption
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SHARED = random_tokens(64, seed=1)  # 4 full blocks
PROMPTS = [SHARED + random_tokens(30 + 3 * i, seed=10 + i) for i in range(4)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-next-ep")
    save_qwen3_next_folder(path, tiny_qwen3_next(num_experts_per_tok=4))
    return path


def _config(folder, ep: int, **kw) -> EngineConfig:
    return EngineConfig(
        model=str(folder),
        num_threads=1,
        cache=CacheConfig(num_blocks=kw.pop("num_blocks", NUM_BLOCKS), block_size=16),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=32, long_prefill_token_threshold=16, step_cost_model="fixed"
        ),
        parallel=ParallelConfig(ep=ep),
        **kw,
    )


def _moe_inputs(num_tokens: int, top_k: int):
    torch.manual_seed(num_tokens)
    num_experts, hidden, inter = 6, 64, 32
    x = torch.randn(num_tokens, hidden)
    w13 = torch.randn(num_experts, 2 * inter, hidden) * 0.2
    w2 = torch.randn(num_experts, hidden, inter) * 0.2
    weights, ids = topk_softmax(torch.randn(num_tokens, num_experts), top_k, True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("num_ranks", [2, 3])
@pytest.mark.parametrize("num_tokens", [1, 15, 63])
@pytest.mark.parametrize("top_k", [2, 4])
def test_expert_slots_combine_to_moe_experts_bit_for_bit(num_ranks, num_tokens, top_k):
    x, w13, w2, weights, ids = _moe_inputs(num_tokens, top_k)
    num_experts, hidden = w13.shape[0], x.shape[1]
    want = moe_experts(x, w13, w2, weights, ids)
    shards = [
        ParallelState(ep_rank=r, ep_size=num_ranks).expert_shard(num_experts)
        for r in range(num_ranks)
    ]
    slots = torch.zeros(num_tokens, top_k, hidden)
    for start, n in shards:  # the all-reduce: each slot is filled by exactly one rank
        part = moe_expert_slots(
            x, w13[start : start + n], w2[start : start + n], weights, ids, start
        )
        assert ((part != 0).any(-1) == ((ids >= start) & (ids < start + n))).all()
        slots += part
    assert torch.equal(sum_expert_slots(slots, ids), want)


def test_per_rank_partial_sums_would_round_differently():
    """Why slots, not partial sums: each rank summing its own experts, then an all-reduce of the
    (T, D) partial sums, adds a token's experts in another order than ep=1."""
    x, w13, w2, weights, ids = _moe_inputs(63, 4)
    parts = []
    for start in (0, 3):
        held = (ids >= start) & (ids < start + 3)  # other ranks' slots: weight 0, any local id
        local_ids = (ids - start).clamp(0, 2)
        parts.append(
            moe_experts(x, w13[start : start + 3], w2[start : start + 3], weights * held, local_ids)
        )
    want = moe_experts(x, w13, w2, weights, ids)
    assert not torch.equal(parts[0] + parts[1], want)
    torch.testing.assert_close(parts[0] + parts[1], want)


def test_expert_shards():
    assert [ParallelState(ep_rank=r, ep_size=2).expert_shard(6) for r in range(2)] == [
        (0, 3),
        (3, 3),
    ]
    assert ParallelState(ep_rank=2, ep_size=3).expert_shard(6) == (4, 2)
    with pytest.raises(ConfigError):
        ParallelState(ep_size=4).expert_shard(6)


def test_each_rank_holds_its_experts_only(folder):
    checkpoint = load_hf_folder(folder)
    full = Qwen3NextForCausalLM(checkpoint.spec, ParallelState())
    full.load_weights(checkpoint.weights)
    moe_layers = [i for i, layer in enumerate(full.layers) if hasattr(layer.mlp, "experts")]
    assert moe_layers == [0, 1, 3, 4]  # layer 2 is dense
    config = _config(folder, 2)
    for rank in range(2):
        parallel = rank_state(config, rank)
        assert (parallel.ep_rank, parallel.ep_size, parallel.tp_size) == (rank, 2, 1)
        model = Qwen3NextForCausalLM(checkpoint.spec, parallel)
        model.load_weights(checkpoint.weights)
        for i in moe_layers:
            mine, every = model.layers[i].mlp.experts, full.layers[i].mlp.experts
            assert (mine.expert_start, mine.num_local) == (3 * rank, 3)
            assert mine.w13.shape == (3, 64, 64) and mine.w2.shape == (3, 64, 32)
            assert torch.equal(mine.w13, every.w13[3 * rank : 3 * rank + 3])
            assert torch.equal(mine.w2, every.w2[3 * rank : 3 * rank + 3])
            # replicated: the router and the shared expert
            assert torch.equal(model.layers[i].mlp.gate.weight, full.layers[i].mlp.gate.weight)
            assert torch.equal(
                model.layers[i].mlp.shared_expert.down_proj.weight,
                full.layers[i].mlp.shared_expert.down_proj.weight,
            )
        num_params = sum(p.numel() for p in model.parameters())
        expert_params = sum(full.layers[i].mlp.experts.w13.numel() for i in moe_layers)
        expert_params += sum(full.layers[i].mlp.experts.w2.numel() for i in moe_layers)
        assert num_params == sum(p.numel() for p in full.parameters()) - expert_params // 2


def test_ep_config(folder):
    assert ParallelConfig(ep=2).world_size == 2
    for bad in ({"ep": 2, "tp": 2}, {"ep": 2, "dcp": 2}, {"ep": 0}):
        with pytest.raises(ConfigError):
            ParallelConfig(**bad)
    with pytest.raises(ConfigError):
        Engine(_config(folder, 4))  # 4 does not divide 6 experts: refused before any worker
    with pytest.raises(ConfigError):
        Engine(replace(_config(folder, 2), model=None))  # SmolLM2 has no experts


@pytest.fixture(scope="module")
def engines(folder):
    ep2 = Engine(_config(folder, 2))
    ep1 = Engine(_config(folder, 1))
    yield ep1, ep2
    ep1.close()
    ep2.close()


def test_ep2_greedy_equals_ep1(engines):
    ep1, ep2 = engines
    prompts = PROMPTS[:3]
    want = [g.token_ids for g in ep1.generate(prompts, GREEDY)]
    assert [g.token_ids for g in ep2.generate(prompts, GREEDY)] == want
    again = ep2.generate(prompts, GREEDY)  # the shared prefix now hits the prefix cache
    assert [g.token_ids for g in again] == want
    assert max(g.usage.cached_tokens for g in again) >= 64
    ep2.check_integrity()


def test_ep2_under_preemption(engines):
    ep1, ep2 = engines
    want = [g.token_ids for g in ep1.generate(PROMPTS, GREEDY)]
    before = ep2.stats().num_preemptions
    assert [g.token_ids for g in ep2.generate(PROMPTS, GREEDY)] == want
    assert ep2.stats().num_preemptions > before
    assert ep2.stats().kv_num_used_blocks == 0
    ep2.check_integrity()


def test_ep2_pages_are_one_replica(engines):
    """Attention is replicated at ep=2: an offload page is one rank's block (as at ep=1), read
    from rank 0 and written to both ranks."""
    ep1, ep2 = engines
    runner = ep2.core.runner
    assert runner.page_bytes == ep1.core.runner.page_bytes
    with ep2._step_lock:  # the loop thread's lock: no step touches the blocks meanwhile
        saved = runner.gather_pages([3, 4])
        assert saved.shape == (2, runner.page_bytes)
        pages = torch.randint(0, 256, saved.shape, dtype=torch.uint8)
        runner.scatter_pages([3, 4], pages)
        assert torch.equal(runner.gather_pages([3, 4]), pages)
        on_rank_1 = runner._call(WorkerCall("gather_pages", ([3, 4],), gather=True))[1]
        assert torch.equal(on_rank_1, pages)
        runner.scatter_pages([3, 4], saved)


def test_ep2_dead_worker(folder):
    prompt = random_tokens(40, seed=3)
    engine = Engine(_config(folder, 2, num_blocks=64))
    try:
        pids = kill_rank_mid_generation(engine, 1, prompt, 400, GREEDY)
    finally:
        engine.close()
    assert_no_process_left(pids)
