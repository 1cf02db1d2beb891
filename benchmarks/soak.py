"""Soak: many concurrent agent sessions under faults for a long time, then proof nothing was lost.

    python benchmarks/soak.py --seconds 60                       # the make-test smoke (CI)
    unshare -n sh -c 'ip link set lo up && .venv/bin/python benchmarks/soak.py --minutes 30 \\
        --json soak.json'                                         # with the Mooncake tier
    python benchmarks/soak.py --topology dp2 --seconds 60       # a router replica killed
    python benchmarks/soak.py --topology pd --seconds 60        # a P or D instance killed
                                                                # (soak_topology.py)

The run is a sequence of phases (``--phase-seconds``). In each, ``--sessions`` tasks run seeded
random scripts against one engine (host + disk tiers, and Mooncake inside a private network
namespace): plain turns, constrained turns (``tool_choice="required"``, ``response_format``),
tool results added, streamed or executed by a flaky tool that raises or hangs past its timeout,
forks and joins, hints, cancellations mid-prefill, mid-decode and mid-tool-stream, a ``break``
out of a stream, a consumer that stops reading for a while, and sessions that end closed or
abandoned (dropped without ``close()``). Each phase but the first injects one fault, in turn:

    disk_corrupt       block files of the disk tier overwritten with garbage every few seconds
    disk_full          every disk write fails with ENOSPC for the middle half of the phase
    mooncake_restart   the Mooncake master killed mid-phase and restarted a second later
    step_crash         an exception raised inside a step: every caller gets EngineDeadError,
                       the dead engine is closed and a new one starts in the same process

Checks (the run exits 1 if one fails):
  - every request that completed (finish "stop" or "length", all greedy) gives exactly the
    tokens a fault-free engine (no tiers, fresh) gives for the same prompt and sampling;
  - after each phase: ``check_integrity()``, and no request, held KV or used block is left;
  - every action ends within ``--action-timeout`` (a hang is a failure, not a stall);
  - at the end: no Python thread or child process more than at the start, no open file more
    than after the first phase (native libraries open their event loops once per process);
  - resident memory after warm-up (one cycle of faults) stays within ``--rss-band-mib``
    (max - min over the later phases; a restarted engine's predecessor is freed a phase late).
"""

from __future__ import annotations

import argparse
import contextvars
import errno
import gc
import json
import os
import random
import sys
import tempfile
import threading
import time
import traceback
import weakref
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path

import anyio

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams, Session
from agentx.config import OffloadConfig
from agentx.engine.offload.mooncake_master import has_private_network
from agentx.errors import (
    EngineDeadError,
    PromptTooLongError,
    RequestAbortedError,
    SessionClosedError,
)
from agentx.session.tool_exec import execute_calls

FAULTS = ("none", "disk_corrupt", "disk_full", "mooncake_restart", "step_crash")
MESSAGES = [
    "Where is the scheduler defined?",
    "Summarize the last tool result in one line.",
    "List two risks of this change.",
    "What should we test next?",
    "Name one file to read.",
    "Explain the error briefly.",
]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 24}},
    "required": ["answer"],
}
TOOL_TIMEOUT_S = 0.5
ACTION = contextvars.ContextVar("action", default="?")  # what each request was sent for
EXPECTED = (RequestAbortedError, EngineDeadError, SessionClosedError, PromptTooLongError)


def lookup(key: str) -> str:
    """Look a key up in the project notes."""
    return f"{key}: see agentx/engine/scheduler/scheduler.py, line {len(key) * 7}"


_flaky_calls = iter(range(1 << 62))


def read_slow_file(path: str) -> str:
    """Read a file from a slow network share."""
    n = next(_flaky_calls)
    if n % 3 == 0:
        raise OSError(f"{path}: share unreachable")
    if n % 3 == 1:
        time.sleep(2 * TOOL_TIMEOUT_S)  # past the timeout: the call is abandoned
    return f"contents of {path}: " + "x = 1\n" * (n % 40)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


# ---- what the run records -----------------------------------------------------------------------


@dataclass
class Counters:
    actions: dict[str, int] = field(default_factory=dict)
    expected_errors: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    sessions_closed: int = 0
    sessions_abandoned: int = 0
    faults: dict[str, int] = field(default_factory=dict)

    def bump(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


class RecordingAdapter(Engine):
    """An engine that keeps every request's prompt, sampling and stream for the replay."""

    def __init__(self, config: EngineConfig, log: RequestLog) -> None:
        super().__init__(config)
        self.log = log
        self.actions: dict[str, str] = {}

    def add_request(self, prompt, sampling=None, **kw):
        stream = super().add_request(prompt, sampling, **kw)
        self.log.add(stream, sampling or SamplingParams())
        self.actions[stream.request_id] = ACTION.get()
        return stream


# ---- one session script -----------------------------------------------------------------------


class Script:
    """One session's seeded random actions; ``run`` plays them to the end."""

    def __init__(self, engine: Engine, rng: random.Random, counters: Counters) -> None:
        self.engine = engine
        self.rng = rng
        self.counters = counters
        salt = rng.choice([None, None, "tenant-a", "tenant-b"])
        tools = [lookup, read_slow_file]
        self.session = Session(engine, tools=tools, sampling=greedy(12), cache_salt=salt)

    async def run(self, num_actions: int, action_timeout: float, deadline: float) -> None:
        """Play up to ``num_actions`` (none starts after ``deadline``), then end the session."""
        actions = [
            (self.turn, 30), (self.tool_turn, 20), (self.cancel, 12), (self.fork_join, 10),
            (self.hint, 10), (self.structured, 6), (self.break_out, 6), (self.slow_reader, 6),
        ]  # fmt: skip
        fns, weights = zip(*actions, strict=True)
        for _ in range(num_actions):
            if time.monotonic() >= deadline:
                break
            action = self.rng.choices(fns, weights)[0]
            self.counters.bump(self.counters.actions, action.__name__)
            ACTION.set(action.__name__)
            try:
                with anyio.fail_after(action_timeout):
                    await action()
            except EXPECTED as exc:
                self.counters.bump(self.counters.expected_errors, type(exc).__name__)
                if isinstance(exc, EngineDeadError | PromptTooLongError):
                    break
            except TimeoutError:
                self.counters.failures.append(f"{action.__name__}: no end in {action_timeout}s")
                break
            except Exception as exc:  # noqa: BLE001 - anything else is a failure to report
                trace = "".join(traceback.format_exception(exc)[-6:])
                self.counters.failures.append(f"{action.__name__}: {exc!r}\n{trace}")
                break
        if self.rng.random() < 0.7:
            await self.session.close()
            self.counters.sessions_closed += 1
        else:
            self.counters.sessions_abandoned += 1  # dropped: its finalizer releases the KV
        self.session = None

    def message(self) -> str:
        return self.rng.choice(MESSAGES)

    async def turn(self) -> None:
        await self.session.send(self.message(), sampling=greedy(self.rng.randint(2, 16)))

    async def structured(self) -> None:
        await self.session.send(
            "Answer in JSON.", sampling=greedy(40), response_format=ANSWER_SCHEMA
        )

    async def hint(self) -> None:
        kind = self.rng.choice(["tool_latency", "pin", "priority", "turns_left", "branch"])
        value = {
            "tool_latency": round(self.rng.uniform(0.1, 2.0), 2),
            "pin": self.rng.random() < 0.5,
            "priority": self.rng.randint(-2, 2),
            "turns_left": self.rng.randint(0, 30),
            "branch": self.rng.randint(1, 4),
        }[kind]
        self.session.hint(**{kind: value})
        await self.turn()

    async def tool_turn(self) -> None:
        s = self.session
        reply = await s.send(self.message(), sampling=greedy(48), tool_choice="required")
        mode = self.rng.choice(["add", "stream", "execute"])
        for call in reply.tool_calls:
            if mode == "stream" and call.ok:
                await self.stream_result(call.id)
            elif mode == "execute":
                ((content, is_error),) = await execute_calls(s.tools, [call], TOOL_TIMEOUT_S)
                s.add_tool_result(call.id, content, is_error)
            else:
                s.add_tool_result(call.id, f"result of {call.name}")
        await s.send(sampling=greedy(self.rng.randint(2, 12)))

    async def stream_result(self, call_id: str) -> None:
        """A streamed tool result, cancelled mid-stream one time in four (then added whole)."""
        chunks = [f"chunk {i}: ok\n" for i in range(self.rng.randint(1, 4))]
        cancel_after = self.rng.randint(1, len(chunks)) if self.rng.random() < 0.25 else None
        with anyio.CancelScope() as scope:
            async with self.session.tool_result(call_id) as out:
                for i, chunk in enumerate(chunks, 1):
                    await out.write(chunk)
                    if i == cancel_after:
                        scope.cancel()
                        await anyio.sleep(0)
        if scope.cancelled_caught:
            self.counters.bump(self.counters.actions, "tool_stream_cancelled")
            self.session.add_tool_result(call_id, "".join(chunks))

    async def cancel(self) -> None:
        """Cancel a long turn mid-prefill (0 events read) or mid-decode."""
        after = self.rng.choice([0, 1, 3, 8])
        with anyio.CancelScope() as scope:
            async with self.session.stream(self.message(), sampling=greedy(64)) as turn:
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
        """Leave the stream early: the turn is rolled back, its KV released."""
        async with self.session.stream(self.message(), sampling=greedy(16)) as turn:
            async for _ in turn:
                if self.rng.random() < 0.5:
                    break

    async def slow_reader(self) -> None:
        """A consumer that stops reading for a while, then reads on."""
        async with self.session.stream(self.message(), sampling=greedy(24)) as turn:
            async for _ in turn:
                await anyio.sleep(self.rng.uniform(0.2, 1.5))
                break
            await turn.get_final_message()

    async def fork_join(self) -> None:
        children = await self.session.fork(self.rng.randint(1, 3))

        async def child_turn(child: Session, message: str, max_tokens: int) -> None:
            try:
                await child.send(message, sampling=greedy(max_tokens))
            except EXPECTED as exc:  # one child failing is that child's business
                self.counters.bump(self.counters.expected_errors, type(exc).__name__)

        async with anyio.create_task_group() as tg:
            for child in children:
                tg.start_soon(child_turn, child, self.message(), self.rng.randint(2, 10))
        await self.session.join(children)


# ---- faults -------------------------------------------------------------------------------------


class Faults:
    """Injects one phase's fault into the engine while the sessions run."""

    def __init__(self, engine: Engine, kind: str, seconds: float, rng: random.Random) -> None:
        self.engine, self.kind, self.seconds, self.rng = engine, kind, seconds, rng
        self.num_injected = 0
        self.crashed = False

    def tier(self, name: str):
        offload = self.engine.core.offload
        return next((t for t in getattr(offload, "store", None).tiers if t.name == name), None)

    async def run(self) -> None:
        if self.kind == "none":
            return
        await getattr(self, self.kind)()

    async def disk_corrupt(self) -> None:
        disk = self.tier("disk")
        deadline = time.monotonic() + self.seconds * 0.8
        while time.monotonic() < deadline:
            await anyio.sleep(2.0)
            files = sorted(disk.folder.rglob("*.kv"))
            for path in self.rng.sample(files, min(4, len(files))):
                size = path.stat().st_size
                with open(path, "r+b") as f:
                    f.seek(self.rng.randrange(size))
                    f.write(os.urandom(64))
                self.num_injected += 1

    async def disk_full(self) -> None:
        disk = self.tier("disk")

        def full(*args) -> None:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        await anyio.sleep(self.seconds / 4)
        disk._write_file = full
        self.num_injected += 1
        try:
            await anyio.sleep(self.seconds / 2)
        finally:
            del disk._write_file

    async def mooncake_restart(self) -> None:
        master = getattr(self.engine.core.offload, "master", None)
        if master is None:
            return
        await anyio.sleep(self.seconds / 3)
        master.kill()
        self.num_injected += 1
        await anyio.sleep(1.0)
        await anyio.to_thread.run_sync(master.start)

    async def step_crash(self) -> None:
        runner = self.engine.core.runner
        execute = runner.execute

        def crash(*args, **kwargs):
            runner.execute = execute
            raise RuntimeError("injected fault inside a step")

        await anyio.sleep(self.seconds / 2)
        runner.execute = crash
        self.num_injected += 1
        self.crashed = True


# ---- phases and checks --------------------------------------------------------------------------


def engine_config(args, folder: Path) -> EngineConfig:
    mooncake = "auto" if args.mooncake else None
    offload = OffloadConfig(
        host_bytes=args.host_mib << 20,
        disk_path=folder,
        disk_bytes=args.disk_mib << 20,
        mooncake=mooncake,
        mooncake_bytes=64 << 20,
        prefetch_margin_s=0.2,
    )
    return EngineConfig(cache=CacheConfig(num_blocks=args.num_blocks), offload=offload)


async def run_phase(engine, args, phase: int, kind: str, counters: Counters) -> Faults:
    rng = random.Random(f"{args.seed}/{phase}/faults")
    faults = Faults(engine, kind, args.phase_seconds, rng)
    deadline = time.monotonic() + args.phase_seconds

    async def session_task(task: int) -> None:
        for n in range(1 << 30):
            if time.monotonic() >= deadline or faults.crashed and engine._dead is not None:
                return
            script_rng = random.Random(f"{args.seed}/{phase}/{task}/{n}")
            script = Script(engine, script_rng, counters)
            await script.run(script_rng.randint(3, 8), args.action_timeout, deadline)

    try:
        with anyio.fail_after(args.phase_seconds + 2 * args.action_timeout):
            async with anyio.create_task_group() as tg:
                tg.start_soon(faults.run)
                for task in range(args.sessions):
                    tg.start_soon(session_task, task)
    except TimeoutError:
        counters.failures.append(f"phase {phase}: the session tasks did not end in time")
    return faults


def wait_idle(engine: Engine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gc.collect()  # abandoned sessions release their KV when collected
        pending = engine.has_pending_controls()  # before the stats: they then show it applied
        stats = engine.stats()
        idle = stats.num_running == stats.num_waiting == 0 and not engine.get_num_live_requests()
        clean = stats.kv_num_held == stats.kv_num_used_blocks == 0  # else: wait, then report
        if idle and clean and not pending:
            return
        time.sleep(0.05)


def check_clean(engine: Engine, phase: int, counters: Counters) -> None:
    wait_idle(engine)
    try:
        engine.check_integrity()
    except AssertionError as exc:
        counters.failures.append(f"phase {phase}: check_integrity: {exc}")
    stats = engine.stats()
    left = (stats.num_running, stats.num_waiting, stats.kv_num_held, stats.kv_num_used_blocks)
    if left != (0, 0, 0, 0) or engine.get_num_live_requests():
        with engine._step_lock:
            actions = getattr(engine, "actions", {})
            held = [(h.handle, actions.get(h.handle), h.pinned) for h in engine.core.kv.held]
            offload = engine.core.offload
            pending = (len(getattr(offload, "loads", ())), len(getattr(offload, "tool_waits", ())))
        counters.failures.append(
            f"phase {phase}: left (running, waiting, held, used) {left}; held {held[:6]}, "
            f"(loads, tool waits) {pending}"
        )


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _fd_target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def resources() -> dict[str, object]:
    children = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                children.append(int(pid))
    return {
        "threads": {t.ident: t.name for t in threading.enumerate() if t.is_alive()},
        "fds": {fd: t for fd in os.listdir("/proc/self/fd") if (t := _fd_target(fd)) != "?"},
        "children": children,
    }


class RequestLog:
    """Every request sent, reduced at each phase's end to a seeded uniform sample of the
    completed ones (reservoir sampling): the replay checks at most ``size`` of them, and the
    soak's own memory stays bounded, so the RSS band measures the engine, not this log."""

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.rng = random.Random(f"{seed}/replay")
        self.pending: list[tuple[object, SamplingParams]] = []
        self.sample: list[tuple[int, array, SamplingParams, list[int]]] = []
        self.num_requests = 0
        self.num_completed = 0
        self.generated_tokens = 0

    def add(self, stream, sampling: SamplingParams) -> None:
        self.pending.append((stream, sampling))
        self.num_requests += 1

    def freeze(self) -> None:
        """Fold the finished streams in (a stream of a dead engine holds its error, whose
        frames hold that engine: none is kept past its phase)."""
        for stream, sampling in self.pending:
            final = stream.final
            if final is None or final.finish_reason not in ("stop", "length"):
                continue
            tokens = list(stream.token_ids)
            self.generated_tokens += len(tokens)
            entry = (self.num_completed, array("i", stream.prompt_token_ids), sampling, tokens)
            self.num_completed += 1
            if len(self.sample) < self.size:
                self.sample.append(entry)
            elif (slot := self.rng.randrange(self.num_completed)) < self.size:
                self.sample[slot] = entry
        self.pending.clear()

    def replayable(self) -> list[tuple[list[int], SamplingParams, list[int]]]:
        """The sample, in the order the requests ran."""
        self.freeze()
        return [(list(p), s, t) for _, p, s, t in sorted(self.sample, key=lambda e: e[0])]


def replay(log: RequestLog, counters: Counters) -> dict[str, int]:
    """Run the sampled completed requests again on a fresh, fault-free engine; count
    mismatches."""
    done = log.replayable()
    mismatches = 0
    with Engine(EngineConfig(cache=CacheConfig(kv_cache_bytes=512 << 20))) as clean:
        for start in range(0, len(done), 16):
            batch = done[start : start + 16]
            streams = [clean.add_request(p, s) for p, s, _ in batch]
            for (prompt, _, expected), stream in zip(batch, streams, strict=True):
                got = stream.result(timeout=600).token_ids
                if got != expected:
                    mismatches += 1
                    if mismatches <= 5:
                        counters.failures.append(
                            f"replay: a {len(prompt)}-token prompt gave {got} (soak: {expected})"
                        )
    return {
        "num_completed": log.num_completed,
        "num_replayed": len(done),
        "num_mismatches": mismatches,
    }


def soak(args) -> dict[str, object]:
    counters = Counters()
    log = RequestLog(args.replay_max, args.seed)
    before = resources()
    rss: list[float] = []
    dead: list[weakref.ref] = []  # engines that crashed: each must be freed
    num_phases = max(1, int(args.seconds // args.phase_seconds))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentx-soak-") as folder:
        engine = RecordingAdapter(engine_config(args, Path(folder)), log)
        try:
            for phase in range(num_phases):
                kind = FAULTS[phase % len(FAULTS)]
                if kind == "mooncake_restart" and not args.mooncake:
                    kind = "none"
                faults = anyio.run(run_phase, engine, args, phase, kind, counters)
                counters.bump(counters.faults, kind)
                if phase == 0:  # native libraries (Mooncake's event loops) open theirs once
                    before["fds"] = resources()["fds"]
                if faults.crashed:
                    dead.append(weakref.ref(engine))
                    engine = restart_after_crash(engine, args, Path(folder), log, counters)
                    faults = None
                else:
                    check_clean(engine, phase, counters)
                log.freeze()
                gc.collect()  # a dead engine's memory goes back before the next phase
                alive = [str(id(r())) for r in dead[:-1] if r() is not None]
                if alive:  # the latest may still be referenced by this phase's last frames
                    counters.failures.append(f"phase {phase}: crashed engines still alive: {alive}")
                rss.append(round(rss_mib(), 1))
                line = f"phase {phase:3d} {kind:17s} rss {rss[-1]:7.1f} MiB"
                line += f" requests {log.num_requests:6d}"
                print(f"{line} failures {len(counters.failures)}", flush=True)
        finally:
            engine.close()
    soak_s = time.monotonic() - t0
    replayed = replay(log, counters)
    leaks = check_leaks(before, counters)
    band = check_rss(rss, args, counters)
    return {
        "seconds": round(soak_s, 1),
        "phases": num_phases,
        "sessions": args.sessions,
        "requests": log.num_requests,
        "generated_tokens": log.generated_tokens,
        **asdict(counters),
        "replay": replayed,
        "leaks": leaks,
        "rss_mib": rss,
        "rss_band_mib": band,
    }


def restart_after_crash(engine, args, folder: Path, log: RequestLog, counters: Counters) -> Engine:
    """The step raised: the engine must report EngineDeadError, close cleanly, and a new one
    must start in the same process."""
    try:
        engine.add_request("after the crash", greedy(1))
        counters.failures.append("step_crash: the dead engine still took a request")
    except EngineDeadError:
        pass
    engine.close()
    return RecordingAdapter(engine_config(args, folder), log)


def check_leaks(before: dict[str, object], counters: Counters) -> dict[str, object]:
    deadline = time.monotonic() + 20.0  # abandoned tool threads end, Mooncake clients unmount
    while True:
        gc.collect()
        now = resources()
        threads = {k: v for k, v in now["threads"].items() if k not in before["threads"]}
        fds = {fd: t for fd, t in now["fds"].items() if before["fds"].get(fd) != t}
        children = [pid for pid in now["children"] if pid not in before["children"]]
        leaks = {
            "threads": sorted(threads.values()),
            "fds": sorted(fds.values()),
            "children": children,
        }
        if not (threads or fds or children) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if leaks["threads"] or leaks["fds"] or leaks["children"]:
        counters.failures.append(f"leaked at the end: {leaks}")
    return leaks


def check_rss(rss: list[float], args, counters: Counters) -> float | None:
    """Resident memory after warm-up (the first ``--warmup-phases``: one whole cycle of faults,
    engine restart included) stays in a band: max - min of the phases after it."""
    steady = rss[args.warmup_phases :]
    if len(steady) < 2:
        return None
    band = max(steady) - min(steady)
    if band > args.rss_band_mib:
        limit = args.rss_band_mib
        counters.failures.append(f"rss grew {band:.0f} MiB after warm-up (band {limit})")
    return round(band, 1)


def _mooncake_imports() -> bool:
    try:
        import mooncake.store  # noqa: F401  (needs libibverbs1)
    except Exception:  # noqa: BLE001 - any failure means: run without the Mooncake tier
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--minutes", type=float, default=None, help="overrides --seconds")
    parser.add_argument("--phase-seconds", type=float, default=12.0)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-blocks", type=int, default=160, help="device pool (tight)")
    parser.add_argument("--host-mib", type=int, default=32)
    parser.add_argument("--disk-mib", type=int, default=256)
    parser.add_argument("--action-timeout", type=float, default=60.0)
    parser.add_argument("--replay-max", type=int, default=3000)
    parser.add_argument("--warmup-phases", type=int, default=len(FAULTS))
    parser.add_argument("--rss-band-mib", type=float, default=300.0)
    parser.add_argument("--no-mooncake", dest="mooncake", action="store_false")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--topology",
        choices=["engine", "dp2", "pd"],
        default="engine",
        help="dp2: a ReplicaRouter, pd: a DisaggCoordinator, a part killed (soak_topology.py)",
    )
    args = parser.parse_args()
    if args.minutes is not None:
        args.seconds = args.minutes * 60
    args.mooncake = args.mooncake and has_private_network() and _mooncake_imports()
    mooncake = "on" if args.mooncake and args.topology == "engine" else "off"
    what = f"{args.sessions} sessions, phases of {args.phase_seconds:.0f}s, mooncake {mooncake}"
    what += f", topology {args.topology}"
    print(f"soak: {args.seconds:.0f}s, {what}", flush=True)
    try:
        if args.topology == "engine":
            result = soak(args)
        else:
            from soak_topology import soak_topology

            result = soak_topology(args)
    except Exception:  # noqa: BLE001 - a crash of the soak itself is a failure to report
        traceback.print_exc()
        return 1
    print(json.dumps({k: v for k, v in result.items() if k != "rss_mib"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    ok = not result["failures"]
    print("soak: OK" if ok else f"soak: FAILED ({len(result['failures'])} failures)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
