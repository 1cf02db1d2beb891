"""DEP (data-parallel attention beside expert parallel) against EP alone and one rank, on CPU.

A random Qwen3-Next-shaped MoE model (``--hidden`` wide, 4 layers: Gated DeltaNet and gated
attention, 16 experts, top 4, a shared expert) is saved to a temporary folder once. Each
configuration runs the model runner directly (no scheduler), one process per rank with one
torch thread each (gloo over loopback, as the engine's workers do); under DEP every rank splits
each step with the executor's own ``AttentionRankManager`` and runs its share (or serves its
experts with none). Two workloads, after a warm-up:

- decode: ``--batch`` requests with a 64-token context each, ``--steps`` decode steps of all
- prefill: ``--tokens`` prompt tokens in one step, as one request (DEP puts it on one rank; the
  other only serves experts) and as ``--batch`` requests of ``tokens / batch`` each

Every torch.distributed collective is timed on each rank; "comm" is that time (waiting for the
other rank included) as a share of the step time. On 2 cores, 2 ranks measure overhead and
correctness, not the speed-up separate devices give: each rank has one core, and EP / DEP
trade attention work against collectives.

    python benchmarks/dep_bench.py                      # decode 8 x 16 steps, prefill 512
    python benchmarks/dep_bench.py --steps 4 --tokens 64 --repeat 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from agentx import env
from agentx.config import CacheConfig, EngineConfig, ParallelConfig
from agentx.engine.executors.dep import AttentionRankManager
from agentx.engine.executors.worker import RankRunner, rank_state
from agentx.engine.models.loader import load_checkpoint
from agentx.engine.outputs import ScheduledRequest, SchedulerOutput
from agentx.engine.runner import ModelRunner
from agentx.engine.sampling import SamplingParams

MODES = {
    "ep1": ParallelConfig(),
    "ep2": ParallelConfig(ep=2),
    "dep2-a2a": ParallelConfig(ep=2, dp_attention=True),
    "dep2-allgather": ParallelConfig(ep=2, dp_attention=True, moe_dispatch="all_gather"),
}
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)
_BLOCK = 16
_CONTEXT = 64  # decode requests' prompt tokens
_COLLECTIVES = ("all_to_all_single", "all_gather", "all_reduce")


@dataclass(frozen=True, slots=True)
class RankResult:
    rank: int
    times_s: dict[str, list[float]]  # workload -> per repeat
    comm_s: dict[str, list[float]]
    comm_calls: dict[str, int]


def save_model(folder: Path, hidden: int) -> None:
    import tokenizers
    import transformers

    config = transformers.Qwen3NextConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=hidden // 8,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=hidden // 8,
        linear_value_head_dim=hidden // 8,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden,
        num_experts=16,
        num_experts_per_tok=4,
        max_position_embeddings=4096,
        layer_types=["linear_attention", "full_attention"] * 2,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.Qwen3NextForCausalLM(config).save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="t1", eos_token="t2"
    ).save_pretrained(folder)


def _item(
    rid: str, tokens: list[int], start: int, blocks: tuple[list[int], ...]
) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=rid,
        token_ids=tokens,
        start_position=start,
        new_block_ids=blocks,
        is_new=start == 0,
        sample=True,
        sampling=_GREEDY,
        seed=0,
        num_output_tokens=0,
    )


def _num_blocks(args: argparse.Namespace) -> int:
    """Blocks of one repeat, per KV group (every request gets fresh ones)."""
    each = args.tokens // args.batch
    decode = args.batch * -(-(_CONTEXT + args.steps) // _BLOCK)
    return decode + -(-args.tokens // _BLOCK) + args.batch * -(-each // _BLOCK)


def _workloads(
    args: argparse.Namespace, tag: int, num_groups: int, block_size: int
) -> dict[str, tuple[list[SchedulerOutput], list[SchedulerOutput]]]:
    """Per workload: (untimed set-up steps, timed steps)."""
    generator = torch.Generator().manual_seed(tag)
    next_block = iter(range(1, 1 << 30))

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 4096, (n,), generator=generator).tolist()

    def blocks(n_tokens: int) -> tuple[list[int], ...]:  # each KV group its own blocks
        n = -(-n_tokens // block_size)
        return tuple([next(next_block) for _ in range(n)] for _ in range(num_groups))

    def step(items: list[ScheduledRequest]) -> SchedulerOutput:
        return SchedulerOutput(items, sum(len(i.token_ids) for i in items), frozenset())

    rids = [f"d{tag}-{i}" for i in range(args.batch)]
    none = tuple([] for _ in range(num_groups))
    setup = step([_item(r, tokens(_CONTEXT), 0, blocks(_CONTEXT + args.steps)) for r in rids])
    decode = [
        step([_item(r, tokens(1), _CONTEXT + s, none) for r in rids]) for s in range(args.steps)
    ]
    each = args.tokens // args.batch
    one = step([_item(f"p{tag}", tokens(args.tokens), 0, blocks(args.tokens))])
    many = step([_item(f"q{tag}-{i}", tokens(each), 0, blocks(each)) for i in range(args.batch)])
    return {
        "decode": ([setup], decode),
        "prefill 1 request": ([], [one]),
        f"prefill {args.batch} requests": ([], [many]),
    }


class _CommClock:
    """Wraps torch.distributed's collectives (looked up at call time by the model code)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        for name in _COLLECTIVES:
            setattr(torch.distributed, name, self._timed(getattr(torch.distributed, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return timed


def _run_rank(rank: int, mode: str, folder: str, args: argparse.Namespace, port: int, queue):
    torch.set_num_threads(1)
    parallel_config = MODES[mode]
    world = parallel_config.world_size
    config = EngineConfig(
        model=folder,
        num_threads=1,
        max_model_len=max(args.tokens, _CONTEXT + args.steps) + _BLOCK,
        cache=CacheConfig(num_blocks=2 + 4 * _num_blocks(args), block_size=_BLOCK),
        parallel=parallel_config,
    )
    extra = {}
    if world > 1:
        env.pin_gloo_to_loopback()
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        extra["parallel"] = rank_state(config, rank)
    checkpoint = load_checkpoint(config.model_path, torch.float32)
    runner = RankRunner(ModelRunner(config, checkpoint.spec, checkpoint.weights, **extra))
    runner.warm_up()
    clock = _CommClock() if world > 1 else None
    # the layout may widen blocks past --block 16 (a hybrid model's attention page grows to the
    # linear state's size): steps are built with the runner's own block size
    block_size = runner.runner.input_batch.block_size
    dep = AttentionRankManager(world, block_size) if parallel_config.dp_attention else None
    times: dict[str, list[float]] = {}
    comms: dict[str, list[float]] = {}
    calls: dict[str, int] = {}
    num_groups = len(runner.runner.layout.groups)
    for i in range(args.repeat + 1):  # the first is a warm-up at full size
        for name, (setup, timed) in _workloads(args, i, num_groups, block_size).items():
            for step in setup:
                _execute(runner, dep, rank, step)
            if world > 1:
                torch.distributed.barrier()
                clock.seconds, clock.calls = 0.0, 0
            start = time.perf_counter()
            for step in timed:
                _execute(runner, dep, rank, step)
            elapsed = time.perf_counter() - start
            done = frozenset(it.request_id for s in timed for it in s.scheduled)
            runner.forget(done)
            if dep is not None:
                dep.forget(done)
            if i:
                times.setdefault(name, []).append(elapsed)
                comms.setdefault(name, []).append(clock.seconds if clock else 0.0)
                calls[name] = clock.calls if clock else 0
    queue.put(RankResult(rank, times, comms, calls))
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _execute(runner: RankRunner, dep: AttentionRankManager | None, rank: int, step) -> None:
    if dep is None:
        runner.execute(step, None)
    else:
        runner.execute_dep(dep.split(step)[rank], None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_mode(args: argparse.Namespace, mode: str, folder: str) -> list[dict]:
    world = MODES[mode].world_size
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    procs = [
        context.Process(target=_run_rank, args=(r, mode, folder, args, port, queue))
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    results = sorted((queue.get(timeout=args.timeout) for _ in procs), key=lambda r: r.rank)
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"{mode}: a rank exited with {proc.exitcode}")
    rows = []
    for name in results[0].times_s:
        # a step ends when the slowest rank ends: per repeat the max over ranks
        times = [max(r.times_s[name][i] for r in results) for i in range(args.repeat)]
        median = statistics.median(times)
        num_tokens = args.batch * args.steps if name == "decode" else args.tokens
        comm = [statistics.median(r.comm_s[name]) for r in results]
        rows.append(
            {
                "mode": mode,
                "workload": name,
                "world_size": world,
                "median_s": median,
                "tokens_per_s": num_tokens / median,
                "comm_share_per_rank": [c / median for c in comm],
                "collectives_per_rank": results[0].comm_calls[name],
                "times_s": times,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {list(MODES)}")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp), args.hidden)
        rows = [row for mode in args.modes.split(",") for row in run_mode(args, mode, tmp)]
    print(
        f"random Qwen3-Next MoE, hidden {args.hidden}, 16 experts top 4; one thread per rank, "
        f"median of {args.repeat} (cpu count {os.cpu_count()})"
    )
    print(f"{'workload':20} {'mode':15} {'time s':>8} {'tok/s':>8}  comm share per rank")
    for r in rows:
        shares = r["comm_share_per_rank"]
        share = " ".join(f"{s:.0%}" for s in shares) if r["world_size"] > 1 else "-"
        print(
            f"{r['workload']:20} {r['mode']:15} {r['median_s']:>8.3f} "
            f"{r['tokens_per_s']:>8.1f}  {share}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
