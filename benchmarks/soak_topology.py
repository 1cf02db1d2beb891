"""The soak over a topology (``soak.py --topology dp2`` or ``--topology pd``): one replica or
instance killed mid-phase, its sessions carry on elsewhere, and nothing is lost.

    python benchmarks/soak.py --topology dp2 --seconds 60
    python benchmarks/soak.py --topology pd --seconds 60

Each phase builds a fresh backend, runs ``--sessions`` tasks of seeded random session scripts
through it (plain turns, cancellations mid-prefill and mid-decode, a ``break`` out of a stream,
and on the router forks and joins), and on every phase but the first kills one part of it
halfway through, in turn:

    dp2   kill_replica_tier        ReplicaRouter, dp=2, one disk folder both replicas write
                                   through: replica 0's step raises (its loop dies); sessions
                                   homed there load their prefix from the tier on the live one
          kill_replica_recompute   the same without a shared tier: they recompute it
    pd    kill_prefill             DisaggCoordinator with 2 P + 1 D: prefill-0's process ends
          kill_decode              1 P + 2 D: decode-0's process ends; the sessions whose KV
                                   it held start cold on the other

A turn the kill interrupts must fail with EngineDeadError (``InstanceDeadError`` on P/D), and
the session then sends again (the same session, its history intact) and must be served: a
session that cannot go on is a failure ("lost"). Checks, as soak.py's: every completed greedy
request equals a fault-free engine's tokens; after each phase the live parts pass
``check_integrity()`` and hold no request, no held KV and no used block; no action hangs; no
thread, process or open file is left at the end.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import anyio
from soak import (
    ACTION,
    MESSAGES,
    Counters,
    RequestLog,
    check_leaks,
    greedy,
    replay,
    resources,
)

from agentx import CacheConfig, EngineConfig, SamplingParams, Session
from agentx.config import DisaggConfig, OffloadConfig, ParallelConfig
from agentx.engine.disagg import DisaggCoordinator
from agentx.engine.router import ReplicaRouter
from agentx.errors import EngineDeadError, RequestAbortedError, SessionClosedError

TOPOLOGY_FAULTS = {
    "dp2": ("none", "kill_replica_tier", "kill_replica_recompute"),
    "pd": ("none", "kill_prefill", "kill_decode"),
}


def recording(cls):
    """``cls`` with every request's prompt, sampling and stream kept for the replay."""

    class Recording(cls):
        log: RequestLog
        actions: dict[str, str]  # request id -> the action that sent it (for a leak's report)

        def add_request(self, prompt, sampling=None, **kw):
            stream = super().add_request(prompt, sampling, **kw)
            self.log.add(stream, sampling or SamplingParams())
            self.actions[stream.request_id] = ACTION.get()
            return stream

    Recording.__name__ = f"Recording{cls.__name__}"
    return Recording


RecordingRouter = recording(ReplicaRouter)
RecordingCoordinator = recording(DisaggCoordinator)


def build(args, kind: str, folder: Path, log: RequestLog):
    base = EngineConfig(cache=CacheConfig(num_blocks=args.num_blocks), num_threads=1)
    shared = OffloadConfig(disk_path=folder, disk_bytes=args.disk_mib << 20)
    if args.topology == "dp2":
        offload = OffloadConfig() if kind == "kill_replica_recompute" else shared
        config = EngineConfig(
            cache=base.cache, offload=offload, parallel=ParallelConfig(dp=2), num_threads=1
        )
        backend = RecordingRouter(config)
    else:
        pd = DisaggConfig(
            num_prefill=2 if kind == "kill_prefill" else 1,
            num_decode=2 if kind == "kill_decode" else 1,
        )
        backend = RecordingCoordinator(EngineConfig(cache=base.cache, offload=shared), pd)
    backend.log, backend.actions = log, {}
    return backend


# ---- one session script ---------------------------------------------------------------------


class TopologyScript:
    """One session's seeded random actions; a turn its replica's death ends is sent again."""

    def __init__(self, backend, rng: random.Random, counters: Counters, forks: bool) -> None:
        self.rng, self.counters = rng, counters
        salt = rng.choice([None, None, "tenant-a", "tenant-b"])
        self.session = Session(backend, sampling=greedy(12), cache_salt=salt)
        self.actions = [(self.turn, 50), (self.cancel, 12), (self.break_out, 8)]
        if forks:
            self.actions.append((self.fork_join, 10))

    async def run(self, num_actions: int, action_timeout: float, deadline: float) -> None:
        fns, weights = zip(*self.actions, strict=True)
        for _ in range(num_actions):
            if time.monotonic() >= deadline:
                break
            action = self.rng.choices(fns, weights)[0]
            if not await self.act(action, action_timeout):
                break
        if self.rng.random() < 0.7:
            await self.session.close()
            self.counters.sessions_closed += 1
        else:
            self.counters.sessions_abandoned += 1  # dropped: its finalizer releases the KV
        self.session = None

    async def act(self, action, action_timeout: float, retry: bool = False) -> bool:
        """Play one action; False ends the session (a failure was recorded)."""
        name = "retried_turn" if retry else action.__name__
        self.counters.bump(self.counters.actions, name)
        ACTION.set(name)
        try:
            with anyio.fail_after(action_timeout):
                await action()
        except EngineDeadError as exc:
            self.counters.bump(self.counters.expected_errors, type(exc).__name__)
            if retry:
                self.counters.failures.append(f"lost: a session's turn failed again: {exc!r}")
                return False
            return await self.act(self.turn, action_timeout, retry=True)  # served elsewhere
        except (RequestAbortedError, SessionClosedError) as exc:
            self.counters.bump(self.counters.expected_errors, type(exc).__name__)
        except TimeoutError:
            self.counters.failures.append(f"{name}: no end in {action_timeout}s")
            return False
        except Exception as exc:  # noqa: BLE001 - anything else is a failure to report
            trace = "".join(traceback.format_exception(exc)[-6:])
            self.counters.failures.append(f"{name}: {exc!r}\n{trace}")
            return False
        return True

    def message(self) -> str:
        return self.rng.choice(MESSAGES)

    async def turn(self) -> None:
        await self.session.send(self.message(), sampling=greedy(self.rng.randint(2, 16)))

    async def cancel(self) -> None:
        after = self.rng.choice([0, 1, 3, 8])
        with anyio.CancelScope() as scope:
            async with self.session.stream(self.message(), sampling=greedy(48)) as turn:
                if after == 0:
                    scope.cancel()
                    await anyio.sleep(0)
                seen = 0
                async for _ in turn:
                    seen += 1
                    if seen >= after:
                        scope.cancel()
                        await anyio.sleep(0)

    async def break_out(self) -> None:
        async with self.session.stream(self.message(), sampling=greedy(16)) as turn:
            async for _ in turn:
                if self.rng.random() < 0.5:
                    break

    async def fork_join(self) -> None:
        children = await self.session.fork(self.rng.randint(1, 2))

        async def child_turn(child: Session) -> None:
            try:
                await child.send(self.message(), sampling=greedy(self.rng.randint(2, 8)))
            except (EngineDeadError, RequestAbortedError) as exc:
                self.counters.bump(self.counters.expected_errors, type(exc).__name__)

        async with anyio.create_task_group() as tg:
            for child in children:
                tg.start_soon(child_turn, child)
        await self.session.join(children)


# ---- the kill and the checks ------------------------------------------------------------------


def kill(backend, kind: str) -> str:
    """End one part of ``backend``; what was killed."""
    if kind.startswith("kill_replica"):
        replica = backend.replicas[0]

        def crash(*args, **kwargs):
            raise RuntimeError("injected fault inside a replica's step")

        replica.core.step = crash
        return "replica-0"
    instance = backend.prefill[0] if kind == "kill_prefill" else backend.decode[0]
    os.kill(instance.pid, signal.SIGKILL)
    return instance.name


async def run_phase(backend, args, phase: int, kind: str, counters: Counters) -> dict:
    deadline = time.monotonic() + args.phase_seconds
    forks = args.topology == "dp2"
    killed: list[str] = []

    async def fault() -> None:
        if kind != "none":
            await anyio.sleep(args.phase_seconds / 2)
            killed.append(kill(backend, kind))

    async def session_task(task: int) -> None:
        for n in range(1 << 30):
            if time.monotonic() >= deadline:
                return
            rng = random.Random(f"{args.seed}/{args.topology}/{phase}/{task}/{n}")
            script = TopologyScript(backend, rng, counters, forks)
            await script.run(rng.randint(3, 8), args.action_timeout, deadline)

    try:
        with anyio.fail_after(args.phase_seconds + 2 * args.action_timeout):
            async with anyio.create_task_group() as tg:
                tg.start_soon(fault)
                for task in range(args.sessions):
                    tg.start_soon(session_task, task)
    except TimeoutError:
        counters.failures.append(f"phase {phase}: the session tasks did not end in time")
    return {"killed": killed}


def live_stats(backend) -> dict:
    if isinstance(backend, ReplicaRouter):
        return {f"replica-{i}": e.stats() for i, e in enumerate(backend.replicas) if not e.is_dead}
    return backend.instance_stats()


def moved_sessions(backend) -> int:
    if isinstance(backend, ReplicaRouter):
        return backend.get_stats().num_moved_sessions
    return backend.counters.num_moved_sessions


def check_clean(backend, phase: int, counters: Counters, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()  # abandoned sessions release their KV when collected
        stats = live_stats(backend)
        left = {
            name: (s.num_running, s.num_waiting, s.kv_num_held, s.kv_num_used_blocks)
            for name, s in stats.items()
            if (s.num_running, s.num_waiting, s.kv_num_held, s.kv_num_used_blocks) != (0,) * 4
        }
        idle = not left and not backend.get_num_live_requests()
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not idle:
        held = []
        if isinstance(backend, ReplicaRouter):
            for engine in backend.replicas:
                if not engine.is_dead:
                    with engine._step_lock:
                        held += [
                            (h.handle, backend.actions.get(h.handle)) for h in engine.core.kv.held
                        ]
        counters.failures.append(
            f"phase {phase}: left (running, waiting, held, used) {left}, "
            f"live requests {backend.get_num_live_requests()}, held {held[:6]}"
        )
    try:
        backend.check_integrity()
    except AssertionError as exc:
        counters.failures.append(f"phase {phase}: check_integrity: {exc}")


def soak_topology(args) -> dict[str, object]:
    counters = Counters()
    log = RequestLog(args.replay_max, args.seed)
    before = resources()
    faults = TOPOLOGY_FAULTS[args.topology]
    num_phases = max(1, int(args.seconds // args.phase_seconds))
    phases = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentx-soak-") as folder:
        for phase in range(num_phases):
            kind = faults[phase % len(faults)]
            backend = build(args, kind, Path(folder) / f"phase-{phase}", log)
            try:
                errors_before = sum(counters.expected_errors.values())
                done = anyio.run(run_phase, backend, args, phase, kind, counters)
                # first: a failed stream's error holds the frames of the session that raised
                # it, and an abandoned session releases its KV only once collected
                log.freeze()
                check_clean(backend, phase, counters)
                moved = moved_sessions(backend)
            finally:
                backend.close()
            counters.bump(counters.faults, kind)
            errors = sum(counters.expected_errors.values()) - errors_before
            phases.append({"fault": kind, **done, "moved_sessions": moved, "errors": errors})
            del backend  # its instances' pipes close once it is collected
            if phase == 0:  # multiprocessing's resource tracker: one process, once per process
                before["fds"], before["children"] = resources()["fds"], resources()["children"]
            line = f"phase {phase:3d} {kind:24s} moved {moved:3d} errors {errors:3d}"
            print(f"{line} requests {log.num_requests:6d} failures {len(counters.failures)}")
    soak_s = time.monotonic() - t0
    replayed = replay(log, counters)
    leaks = check_leaks(before, counters)
    return {
        "topology": args.topology,
        "seconds": round(soak_s, 1),
        "phases": num_phases,
        "sessions": args.sessions,
        "requests": log.num_requests,
        "generated_tokens": log.generated_tokens,
        "moved_sessions": sum(p["moved_sessions"] for p in phases),
        "per_phase": phases,
        **asdict(counters),
        "replay": replayed,
        "leaks": leaks,
    }
