"""One rank's worker process: joins the process group, builds its runner, serves calls.

    caller (MultiprocExecutor)                 worker rank r
        WorkerCall(method, args)  --pipe-->    getattr(RankRunner, method)(*args)
        result | None | WorkerFailure  <--     (rank 0 returns results; others None unless
                                               the call gathers from every rank)

Every rank receives the same calls in the same order, so the collectives inside the model
line up. A worker exits when it is told to close, when its pipe closes (the caller is gone)
or after it reports a failure; it never outlives its caller.
"""

from __future__ import annotations

import os
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import torch

from agentx import env
from agentx.config import EngineConfig
from agentx.engine.kv_cache import BlockCopy, KVCacheLayout
from agentx.engine.models.loader import load_checkpoint
from agentx.engine.outputs import GrammarMasks, ModelRunnerOutput, SchedulerOutput
from agentx.engine.parallel.state import ParallelState
from agentx.engine.runner import ModelRunner
from agentx.engine.runner.model_runner import DTYPES


@dataclass(frozen=True, slots=True)
class WorkerCall:
    method: str
    args: tuple = ()
    gather: bool = False  # every rank returns its result, not only rank 0


@dataclass(frozen=True, slots=True)
class WorkerReady:
    layout: KVCacheLayout
    max_model_len: int
    page_bytes: int
    pid: int


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    rank: int
    error: str  # repr and traceback: the exception itself may not pickle


CLOSE = WorkerCall("close")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a spawned worker needs to start (pickled to it)."""

    config: EngineConfig
    rank: int
    world_size: int
    init_method: str
    backend: str
    num_threads: int


class RankRunner:
    """The calls a worker serves: its runner's, with what crosses the pipe made picklable."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(
        self, out: SchedulerOutput, masks: tuple[list[str], torch.Tensor] | None
    ) -> ModelRunnerOutput:
        grammar = None
        if masks is not None:  # the bitmask was computed in the caller's process
            future: Future = Future()
            future.set_result(masks[1])
            grammar = GrammarMasks(masks[0], future)
        return self.runner.execute(out, grammar)

    def execute_dep(
        self, out: SchedulerOutput, masks: tuple[list[str], torch.Tensor] | None
    ) -> ModelRunnerOutput:
        """Data-parallel attention: this rank's share of the step (executors/dep.py); with
        none, it still serves its experts to the other ranks."""
        if out.scheduled:
            return self.execute(out, masks)
        return self.runner.execute_idle(out)

    def forget(self, request_ids: frozenset[str]) -> None:
        self.runner.forget(request_ids)

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        self.runner.copy_blocks(copies)

    def gather_pages(self, block_ids: list[int]) -> torch.Tensor:
        return self.runner.gather_pages(block_ids)

    def scatter_pages(self, block_ids: list[int], pages: torch.Tensor) -> None:
        self.runner.scatter_pages(block_ids, pages)

    def warm_up(self) -> None:
        self.runner.warm_up()

    def get_request_ids(self) -> set[str]:
        return self.runner.get_request_ids()

    def get_num_rows_run(self) -> int:
        return self.runner.num_rows_run

    def ping(self) -> int:
        return os.getpid()


def run_worker(spec: WorkerSpec, conn: Connection) -> None:
    """The worker process's entry point (spawned by ``MultiprocExecutor``)."""
    try:
        runner = _start(spec)
        conn.send(WorkerReady(runner.layout, runner.max_model_len, runner.page_bytes, os.getpid()))
    except BaseException:  # noqa: BLE001 - reported to the caller, which raises it
        _report(conn, spec.rank)
        return
    served = RankRunner(runner)
    try:
        _serve(served, conn, spec.rank)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _start(spec: WorkerSpec) -> ModelRunner:
    env.pin_gloo_to_loopback()
    torch.set_num_threads(spec.num_threads)
    config = spec.config
    if config.device.startswith("cuda"):
        torch.cuda.set_device(spec.rank)
        config = replace(config, device=f"cuda:{spec.rank}")
    torch.distributed.init_process_group(
        spec.backend, init_method=spec.init_method, rank=spec.rank, world_size=spec.world_size
    )
    parallel = rank_state(config, spec.rank)
    checkpoint = load_checkpoint(
        config.model_path, DTYPES[config.dtype], keep_quantized=config.quantization != "none"
    )
    return ModelRunner(config, checkpoint.spec, checkpoint.weights, parallel)


def rank_state(config: EngineConfig, rank: int) -> ParallelState:
    """This rank's place: the ep world, or the tp x dcp grid, tensor parallel innermost:
    ``rank = dcp_rank * tp + tp_rank``::

        tp=2, dcp=2          tp_rank 0        tp_rank 1
          dcp_rank 0         rank 0           rank 1        <- tp group {0, 1}
          dcp_rank 1         rank 2           rank 3        <- tp group {2, 3}
                             dcp group {0, 2} dcp group {1, 3}

    A rank holds its TP head shard of the positions p with p % dcp == dcp_rank. A tp group
    (same positions, every head shard) all-reduces the row-parallel outputs and gathers the
    vocabulary; a dcp group (same head shard, every position class) merges its ranks'
    partial attention. Every rank creates every group, in the same order (``new_group`` is a
    collective over the whole world).
    """
    if config.parallel.ep > 1:  # ep is the world on its own (ParallelConfig)
        world = torch.distributed.group.WORLD
        return ParallelState(
            ep_rank=rank,
            ep_size=config.parallel.ep,
            ep_group=world,
            dp_attention=config.parallel.dp_attention,
            moe_dispatch=config.parallel.moe_dispatch,
        )
    tp, dcp = config.parallel.tp, config.parallel.dcp
    dcp_rank, tp_rank = divmod(rank, tp)
    tp_groups = [_new_group([d * tp + t for t in range(tp)]) for d in range(dcp)]
    dcp_groups = [_new_group([d * tp + t for d in range(dcp)]) for t in range(tp)]
    return ParallelState(
        tp_rank,
        tp,
        tp_groups[dcp_rank],
        dcp_rank,
        dcp,
        dcp_groups[tp_rank],
        pcp_size=config.parallel.pcp,  # the dcp ranks, split along a prefill's rows
    )


def _new_group(ranks: list[int]) -> Any:
    """A process group over ``ranks``; None for one rank (its collectives are no-ops)."""
    if len(ranks) == 1:
        return None
    if len(ranks) == torch.distributed.get_world_size():
        return torch.distributed.group.WORLD
    return torch.distributed.new_group(ranks)


def _serve(served: RankRunner, conn: Connection, rank: int) -> None:
    while True:
        try:
            call: WorkerCall = conn.recv()
        except (EOFError, OSError):  # the caller is gone
            return
        if call.method == CLOSE.method:
            return
        try:
            result: Any = getattr(served, call.method)(*call.args)
        except BaseException:  # noqa: BLE001 - reported; the caller fails the engine
            _report(conn, rank)
            return
        conn.send(result if call.gather or rank == 0 else None)


def _report(conn: Connection, rank: int) -> None:
    try:
        conn.send(WorkerFailure(rank, traceback.format_exc()))
    except (OSError, EOFError):
        pass
