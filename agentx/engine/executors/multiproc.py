"""MultiprocExecutor: one spawned worker process per rank, driven from the caller's process.

    EngineCore (caller)                     worker 0 .. worker N-1 (worker.py)
      execute(out) --WorkerCall--> each pipe     runner.execute(out)  (collectives between ranks)
                  <--result (rank 0), None (others)

Every call goes to every rank under one lock (the same calls in the same order on every rank),
then waits for every rank's answer together with every worker's process sentinel: a worker
that dies or raises fails the call with :class:`EngineDeadError` at once, the others are
killed (a survivor may be stuck in a collective with the dead one), and every later call
raises the same. ``close()`` asks the workers to exit, kills what does not, and reaps them all.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from agentx.config import EngineConfig
from agentx.engine.executors.dep import AttentionRankManager
from agentx.engine.executors.executor import Executor
from agentx.engine.executors.worker import (
    CLOSE,
    WorkerCall,
    WorkerFailure,
    WorkerReady,
    WorkerSpec,
    run_worker,
)
from agentx.engine.kv_cache import BlockCopy
from agentx.engine.models.spec import ModelSpec
from agentx.engine.outputs import GrammarMasks, ModelRunnerOutput, SchedulerOutput
from agentx.engine.parallel.bootstrap import (
    refuse_spawn_while_bootstrapping,
    unguarded_main_error,
)
from agentx.errors import EngineDeadError

_CLOSE_TIMEOUT_S = 10.0


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, spec: ModelSpec) -> None:
        self.spec = spec
        self.world_size = config.parallel.world_size
        # expert parallel replicates attention: every rank holds the same KV, one rank's page is
        # the block (gathered from rank 0, scattered to all); with data-parallel attention a
        # rank's page too, gathered from the rank that wrote it (dep.py)
        self._kv_replicated = config.parallel.ep > 1
        self._dep: AttentionRankManager | None = None
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._closed = False
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[Connection] = []
        refuse_spawn_while_bootstrapping()
        context = multiprocessing.get_context("spawn")  # fork would copy the caller's threads
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        backend = _backend(config)
        threads = config.num_threads or max(1, (os.cpu_count() or 1) // self.world_size)
        try:
            for rank in range(self.world_size):
                ours, theirs = context.Pipe()
                spec_r = WorkerSpec(config, rank, self.world_size, init_method, backend, threads)
                proc = context.Process(
                    target=run_worker,
                    args=(spec_r, theirs),
                    name=f"agentx-rank-{rank}",
                    daemon=True,
                )
                proc.start()
                theirs.close()
                self._procs.append(proc)
                self._conns.append(ours)
            readies: list[WorkerReady] = self._collect(range(self.world_size))
        except BaseException:
            self.close()
            raise
        self.layout = readies[0].layout
        self.max_model_len = readies[0].max_model_len
        self._page_bytes = [r.page_bytes for r in readies]  # ranks may hold different heads
        if config.parallel.dp_attention:
            self._dep = AttentionRankManager(self.world_size, self.layout.block_size)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    @property
    def page_bytes(self) -> int:
        return self._page_bytes[0] if self._kv_replicated else sum(self._page_bytes)

    # ---- the executor protocol -----------------------------------------------------------

    def execute(self, out: SchedulerOutput, masks: GrammarMasks | None = None) -> ModelRunnerOutput:
        sent = None if masks is None else (masks.request_ids, masks.future.result())
        if self._dep is None:
            return self._call(WorkerCall("execute", (out, sent)))
        parts = self._dep.split(out)  # places new requests: before their masks are split
        part_masks = self._dep.split_masks(sent)
        self._copy_between_ranks(self._dep.take_copies())
        calls = [
            WorkerCall("execute_dep", (part, part_mask), gather=True)
            for part, part_mask in zip(parts, part_masks, strict=True)
        ]
        return AttentionRankManager.merge(self._call(calls))

    def _copy_between_ranks(self, copies: list[tuple[int, int, int]]) -> None:
        """DEP: copy hit blocks to the rank that runs the request (executors/dep.py)."""
        for src in range(self.world_size):
            for dst in range(self.world_size):
                ids = [b for b, s, d in copies if (s, d) == (src, dst)]
                if not ids:
                    continue
                pages = self._call(WorkerCall("gather_pages", (ids,), gather=True))[src]
                calls = [WorkerCall("ping")] * self.world_size
                calls[dst] = WorkerCall("scatter_pages", (ids, pages))
                self._call(calls)

    def forget(self, request_ids: frozenset[str]) -> None:
        if request_ids:
            if self._dep is not None:
                self._dep.forget(request_ids)
            self._call(WorkerCall("forget", (request_ids,)))

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        if copies:
            if self._dep is not None:
                self._dep.copy_blocks(copies)
            self._call(WorkerCall("copy_blocks", (copies,)))

    def gather_pages(self, block_ids: list[int]) -> torch.Tensor:
        if self._dep is not None:  # each block from the rank that wrote it
            parts = self._call(WorkerCall("gather_pages", (block_ids,), gather=True))
            owners = [max(self._dep.owner_of(b), 0) for b in block_ids]
            return torch.stack([parts[r][i] for i, r in enumerate(owners)])
        if self._kv_replicated:
            return self._call(WorkerCall("gather_pages", (block_ids,)))  # rank 0's
        parts = self._call(WorkerCall("gather_pages", (block_ids,), gather=True))
        return torch.cat(parts, dim=1)  # (n, sum of the ranks' page bytes)

    def scatter_pages(self, block_ids: list[int], pages: torch.Tensor) -> None:
        if self._dep is not None:
            self._dep.mark_everywhere(block_ids)
        if self._kv_replicated:
            self._call(WorkerCall("scatter_pages", (block_ids, pages)))
            return
        parts = pages.view(len(block_ids), -1).split(self._page_bytes, dim=1)
        calls = [WorkerCall("scatter_pages", (block_ids, p.contiguous())) for p in parts]
        self._call(calls)

    def warm_up(self) -> None:
        self._call(WorkerCall("warm_up"))

    def get_request_ids(self) -> set[str]:
        if self._dep is None:
            return self._call(WorkerCall("get_request_ids"))
        rows = self._call(WorkerCall("get_request_ids", gather=True))
        self._dep.check_integrity(rows)
        return set().union(*rows)

    # ---- calls ---------------------------------------------------------------------------

    def _call(self, call: WorkerCall | list[WorkerCall]) -> Any:
        """Send ``call`` (or one call per rank) to every rank; rank 0's answer, or every
        rank's when the call gathers."""
        calls = call if isinstance(call, list) else [call] * self.world_size
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            if self._closed:
                raise EngineDeadError("the executor's workers were closed")
            try:
                for conn, one in zip(self._conns, calls, strict=True):
                    conn.send(one)
            except (OSError, EOFError):
                pass  # a dead worker: its sentinel says so below
            results = self._collect(range(self.world_size))
        return results if calls[0].gather else results[0]

    def _collect(self, ranks: range) -> list[Any]:
        """Every rank's answer; a death or failure anywhere kills all workers and raises."""
        results: dict[int, Any] = {}
        waiting = {self._conns[r]: r for r in ranks}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while waiting:
            ready = wait([*waiting, *sentinels])
            for conn in [c for c in ready if c in waiting]:
                rank = waiting.pop(conn)
                results[rank] = self._receive(conn, rank)
            for sentinel in [s for s in ready if s in sentinels]:
                rank = sentinels[sentinel]
                conn = self._conns[rank]
                if conn in waiting and conn.poll():  # its last words (a failure) first
                    del waiting[conn]
                    results[rank] = self._receive(conn, rank)
                self._fail_exited(rank, "died")
        return [results[r] for r in ranks]

    def _receive(self, conn: Connection, rank: int) -> Any:
        try:
            result = conn.recv()
        except (EOFError, OSError):
            self._fail_exited(rank, "closed its pipe")
        if isinstance(result, WorkerFailure):
            self._fail(f"worker rank {rank} raised:\n{result.error}")
        return result

    def _fail_exited(self, rank: int, what: str) -> None:
        proc = self._procs[rank]
        proc.join(1.0)  # its sentinel fires (its pipe closes) just before it is reapable
        unguarded = unguarded_main_error(proc.exitcode, f"worker rank {rank}")
        if unguarded is not None:
            self._fail(str(unguarded))
        self._fail(f"worker rank {rank} (pid {proc.pid}) {what}, exit {proc.exitcode}")

    def _fail(self, reason: str) -> None:
        self._dead = reason
        self._kill()
        raise EngineDeadError(reason)

    # ---- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Ask every worker to exit, kill those that do not in time, reap all. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for conn, proc in zip(self._conns, self._procs, strict=False):
            if proc.is_alive():
                try:
                    conn.send(CLOSE)
                except (OSError, EOFError):
                    pass
        for proc in self._procs:
            proc.join(_CLOSE_TIMEOUT_S)
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join()
        for conn in self._conns:
            conn.close()


def _backend(config: EngineConfig) -> str:
    choice = config.parallel.backend
    if choice != "auto":
        return choice
    return "nccl" if config.device.startswith("cuda") else "gloo"


def _free_port() -> int:
    """A loopback port nobody listens on now (rank 0's store binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
