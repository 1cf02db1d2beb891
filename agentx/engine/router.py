"""Data-parallel replicas behind a session router, in the caller's process.

    ReplicaRouter.route(prompt, session_id=...)  (add_request: the backend interface)
        -> RouterPolicy.choose(session_id, loads) -> replica r
        -> (the session moved and the policy migrates KV) source.flush_offload / export_held
           -> r.import_held                                 (through the shared tier)
        -> replicas[r].add_request(...)

Each replica is a whole :class:`Engine` (its own scheduler, KV pool, loop thread and, with
tp > 1, its own worker processes). A session's KV lives on the replica that ran its last turn, so
the policy that wins agent traffic is sticky: a session stays where its KV is; a first turn
(cold, often long) goes to the least-loaded replica. Round-robin and least-loaded are the
baselines the benchmarks compare it with.

Prefix-aware first turns: a first turn is not always cold. A subagent's prompt forks from its
parent's context, and sessions of one tenant share a system prompt; that prefix is cached on
the replica that served it. The router keeps a :class:`PrefixIndex` (the chained hashes of the
full blocks of every prompt it sent to each replica, an LRU per replica) and gives the policy,
per replica, how many of the request's leading tokens it last sent there
(``ReplicaLoad.num_cached_tokens``). The sticky policy sends a first turn to the replica with
the longest such prefix when that is at least ``prefix_min_tokens`` and the replica is not
more than ``prefix_load_slack`` live requests busier than the least loaded; otherwise to the
least loaded. It is an estimate (a replica may have evicted the blocks since): a wrong guess
costs a recompute, never a wrong token.

Migration: ``StickySessionPolicy(migrate_after=k)`` moves a waiting session (its next turn is
being routed) off a home replica that has more than ``k`` live requests more than the least
loaded one. Its KV moves with it through a tier both replicas read (``OffloadConfig.disk_path``
one folder for all, or a running Mooncake master): every replica writes the blocks it computes
through to its tiers, so the router only waits for the home replica's queued stores
(``flush_offload``), and the new replica's prefix lookup finds the session's blocks in the tier
and loads them instead of recomputing. Held KV named by the request (``held_kv``) is exported
from the home replica, imported on the new one, and released at home. The router refuses a
migrating policy without a shared tier. Routing holds the router's lock, migration included,
and the home replica's loop pauses while its queued stores land.

Migration during the tool wait: a held turn whose ``ToolLatency`` hint is at least
``tool_wait_move_s`` registers a finish callback on its stream; when the turn ends (on the
replica's loop thread) the callback only queues a job for the router's mover thread, which asks
the policy (``choose_move``: the same overload rule) and, off the router's lock, exports the
held KV at home, imports it on the target under the same handle and releases it at home. The
session's next turn, routed meanwhile, waits for the move and goes where its KV landed.

As an :class:`EngineBackend` the router needs no session ids: a request continuing held KV
belongs to the session that left it; forks are sessions placed beside their parent.

Prefill windows: with ``prefill_schedule_interval`` N > 1 the replicas share one
:class:`StepClock` (``align_prefills``), so they open their prefill windows on the same step
indices, as DP ranks that step in lockstep would (scheduler/step_clock.py says what that buys
in-process).

Replicas run in one process. ``torch.set_num_threads`` acts on the calling thread (OpenMP): a
replica sets its ``num_threads`` on the thread that builds it, and the loop thread it starts
then runs with that count (tests/engine/test_router.py: two replicas at 1 thread each, the caller's
thread keeps its own).
The loop threads share the GIL for the Python side of their steps (the ops release it).

A dead replica (its loop crashed: ``Engine.is_dead``) gets no more work. Its load says
``alive=False``; the built-in policies choose among the live replicas only, and the router
falls back to the least-loaded live replica if a policy chooses a dead one anyway. A session
whose home died moves on its next turn: its prefix loads from a tier the replicas share when
there is one (what the dead replica wrote through before it died), else is recomputed; held KV
named by the request died with the replica, so the request runs without it. ``get_stats``
counts the dead replicas and the moved sessions. With every replica dead the router raises
EngineDeadError.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import dataclass, fields, replace

from agentx.config import EngineConfig, OffloadConfig
from agentx.engine.backend import EngineBackend, EngineCapabilities, Prompt
from agentx.engine.client import Engine
from agentx.engine.hints import ToolLatency
from agentx.engine.outputs import EngineStats
from agentx.engine.request import RequestOptions
from agentx.engine.router_policy import (
    POLICIES,
    LeastLoadedPolicy,
    PrefixIndex,
    ReplicaLoad,
    RoundRobinPolicy,
    RouterPolicy,
    StickySessionPolicy,
    least_loaded,
)
from agentx.engine.sampling import SamplingParams
from agentx.engine.scheduler import StepClock
from agentx.engine.streams import RequestStream
from agentx.errors import ConfigError, EngineClosedError, EngineDeadError

logger = logging.getLogger("agentx.engine")


@dataclass(frozen=True, slots=True)
class RouterStats:
    num_replicas: int
    num_dead_replicas: int
    num_migrations: int  # sessions moved with their KV off a live, overloaded home
    num_moved_sessions: int  # sessions moved off a dead home (their held KV lost)
    num_tool_wait_migrations: int = 0  # of num_migrations: moved while waiting on a tool


@dataclass(frozen=True, slots=True)
class Migration:
    """A session the router moved, with its KV, from one replica to another."""

    session_id: str
    source: int
    target: int
    num_held_tokens: int  # tokens of held KV imported on the target (0: the prefix cache only)
    during_tool_wait: bool = False  # moved while its tool ran, not when its next turn came


@dataclass(frozen=True, slots=True)
class _ToolWaitMove:
    """A held turn of ``session_id`` whose tool will run ``seconds``: the mover thread's job."""

    session_id: str
    handle: str
    seconds: float


def has_shared_tier(offload: OffloadConfig) -> bool:
    """Do replicas built from one ``offload`` config read one tier? A disk folder, or a running
    Mooncake master; not ``mooncake="auto"`` (each replica would start its own master)."""
    return offload.disk_path is not None or offload.mooncake not in (None, "auto")


class ReplicaRouter(EngineBackend):
    """``config.parallel.dp`` engine replicas (each built with dp=1) and a routing policy.

    ``align_prefills``: the replicas share one StepClock, so ``prefill_schedule_interval``
    opens their prefill windows on the same step indices. ``prefix_index_blocks``: the prefix
    index's cap per replica (whole blocks). ``tool_wait_move_s``: a held turn whose
    ``ToolLatency`` is at least this many seconds may move during the tool wait (a policy that
    migrates KV only; None: never). Raises ConfigError for an unknown policy name, or a
    policy that migrates KV without a tier the replicas share.

    As an :class:`EngineBackend` (``Session(router)``) a session is the chain of its held
    KV: a request continuing held KV ``h`` belongs to ``h``'s session and is routed there; one
    continuing none starts a session named by its request id.
    """

    def __init__(
        self,
        config: EngineConfig,
        policy: str | RouterPolicy = "sticky",
        *,
        align_prefills: bool = True,
        prefix_index_blocks: int = 1 << 16,
        tool_wait_move_s: float | None = 1.0,
    ) -> None:
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ConfigError(f"router policy must be one of {sorted(POLICIES)}: {policy!r}")
            policy = POLICIES[policy]()
        if policy.migrates_kv and not has_shared_tier(config.offload):
            raise ConfigError(
                "a policy that migrates KV needs a tier the replicas share: "
                "OffloadConfig(disk_path=...) or a running Mooncake master's address"
            )
        self.policy = policy
        self.tool_wait_move_s = tool_wait_move_s
        one = replace(config, parallel=replace(config.parallel, dp=1))
        self.step_clock = StepClock() if align_prefills else None
        self.replicas: list[Engine] = []
        try:
            for _ in range(config.parallel.dp):
                self.replicas.append(Engine(one, step_clock=self.step_clock))
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()
        self.prefix_index = PrefixIndex(
            len(self.replicas), config.cache.block_size, prefix_index_blocks
        )
        self._sessions: list[set[str]] = [set() for _ in self.replicas]
        # held KV handle -> its session; read and popped without the lock (GIL-atomic dict
        # operations) by release_held_eventually, which must never block
        self._handles: dict[str, str] = {}
        self._home: dict[str, int] = {}  # session -> replica (what _sessions says, by session)
        self._moving: dict[str, threading.Event] = {}  # sessions the mover is moving now
        self._moves: queue.SimpleQueue[_ToolWaitMove | None] = queue.SimpleQueue()
        self._moves_done = threading.Condition()
        self._num_moves_queued = self._num_moves_run = 0
        self._ids = itertools.count()
        self._closed = False
        self.migrations: list[Migration] = []
        self.num_moved_sessions = 0  # off a dead replica
        self.tokenizer = self.replicas[0].tokenizer
        self.max_model_len = self.replicas[0].max_model_len
        self._mover = threading.Thread(target=self._run_mover, name="agentx-router", daemon=True)
        self._mover.start()

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        options: RequestOptions | None = None,
    ) -> RequestStream:
        """The backend interface: route by the session the held KV names (see the class)."""
        options = options or RequestOptions()
        rid = request_id if request_id is not None else f"dp-{next(self._ids)}"
        session_id = self._handles.get(options.held_kv, rid) if options.held_kv else rid
        _, stream = self.route(prompt, sampling, session_id=session_id, request_id=rid,
                               options=options)  # fmt: skip
        return stream

    def route(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        session_id: str | None = None,
        **options,
    ) -> tuple[int, RequestStream]:
        """Route and queue a request; the replica chosen and the request's stream. A session's
        ``held_kv`` handle (``Engine.add_request``) only means something on its own replica:
        the sticky policy keeps it there, and a migration moves it to the new replica."""
        if self._closed:
            raise EngineClosedError("the router is closed")
        token_ids = self.replicas[0].tokenize(prompt)  # also refuses a bad prompt, unrouted
        request_options = options.get("options")
        salt = options.get("cache_salt") or getattr(request_options, "cache_salt", None)
        hashes = self.prefix_index.hashes(token_ids, salt)  # pure: outside the lock
        while True:
            with self._lock:
                moving = self._moving.get(session_id) if session_id is not None else None
                if moving is None:
                    replica, options = self._place(session_id, hashes, options)
                    break
            moving.wait()  # its KV is on the way to another replica: go where it lands
        stream = self.replicas[replica].add_request(token_ids, sampling, **options)
        if session_id is not None:
            self._track(session_id, stream, options)
        return replica, stream

    def _place(self, session_id: str | None, hashes: list[int], options: dict) -> tuple[int, dict]:
        """Choose the replica (under the router's lock) and move the session's KV there."""
        cached = self.prefix_index.matched_tokens(hashes)
        loads = self._loads(cached)
        if not any(load.alive for load in loads):
            raise EngineDeadError("every replica of the router is dead")
        source = self._placed_on(session_id)
        replica = self.policy.choose(session_id, loads)
        if not loads[replica].alive:  # a policy that does not look at ``alive``
            replica = least_loaded(loads)
        if session_id is not None:
            self._handles.pop(_held_kv(options), None)  # the request adopts it (or it died)
            if source is not None and not loads[source].alive:
                options = self._move_off_dead(options)
            elif source is not None and source != replica and self.policy.migrates_kv:
                options = self._migrate(session_id, source, replica, options)
            self._set_placement(session_id, replica)
        self.prefix_index.record(replica, hashes)
        return replica, options

    def _loads(self, cached: list[int] | None = None) -> list[ReplicaLoad]:
        cached = cached or [0] * len(self.replicas)
        return [
            ReplicaLoad(engine.get_num_live_requests(), len(sessions), n, alive=not engine.is_dead)
            for engine, sessions, n in zip(self.replicas, self._sessions, cached, strict=True)
        ]

    def _set_placement(self, session_id: str, replica: int) -> None:
        for r, sessions in enumerate(self._sessions):
            (sessions.add if r == replica else sessions.discard)(session_id)
        self._home[session_id] = replica

    def _track(self, session_id: str, stream: RequestStream, options: dict) -> None:
        """A held turn names its session; a long tool wait after it may move the session."""
        request_options = options.get("options") or RequestOptions()
        if not (options.get("hold_kv") or request_options.hold_kv):
            return
        self._handles[stream.request_id] = session_id
        hints = options.get("hints") or request_options.hints
        waits = [h.seconds for h in hints if isinstance(h, ToolLatency)]
        limit = self.tool_wait_move_s
        if waits and limit is not None and waits[-1] >= limit and self.policy.migrates_kv:
            move = _ToolWaitMove(session_id, stream.request_id, waits[-1])
            stream.add_finish_callback(lambda final: self._queue_move(move) if final else None)

    def _placed_on(self, session_id: str | None) -> int | None:
        return self._home.get(session_id) if session_id is not None else None

    def _move_off_dead(self, options: dict) -> dict:
        """A session whose home died: its held KV died with it (the request runs without it;
        its prefix loads from a shared tier when there is one, else is recomputed)."""
        self.num_moved_sessions += 1
        options = {**options, "held_kv": None}
        if options.get("options") is not None:
            options["options"] = replace(options["options"], held_kv=None)
        return options

    def _migrate(self, session_id: str, source: int, target: int, options: dict) -> dict:
        """Make the session's KV on ``source`` loadable on ``target``; the request's options
        with ``held_kv`` naming the imported copy (when it named held KV)."""
        handle = _held_kv(options)
        num_held = 0
        if handle is None:
            self.replicas[source].flush_offload()  # the target's prefix lookup loads them
        else:
            imported, num_held = self._move_held(handle, source, target)
            options = {**options, "held_kv": imported}
            if options.get("options") is not None:
                options["options"] = replace(options["options"], held_kv=imported)
        self.migrations.append(Migration(session_id, source, target, num_held))
        return options

    def _move_held(
        self, handle: str, source: int, target: int, keep_on_failure: bool = False
    ) -> tuple[str | None, int]:
        """Export held KV at ``source``, import it on ``target`` under the same handle, release
        it at home (``keep_on_failure``: not when nothing was imported). The imported handle
        (None: nothing loaded) and its token count."""
        src, dst = self.replicas[source], self.replicas[target]
        export = src.export_held(handle)  # waits for its stores, like flush_offload
        imported = dst.import_held(export, handle) if export is not None else None
        if imported is not None or not keep_on_failure:
            src.release_held(handle)  # the session left: the tier (and the target) hold it
        return imported, len(export.token_ids) if imported is not None else 0

    # ---- moving a session while its tool runs (the mover thread) -------------------------

    def _run_mover(self) -> None:
        while (move := self._moves.get()) is not None:
            try:
                self._move_in_tool_wait(move)
            except Exception:  # noqa: BLE001 - a failed move leaves the session home
                logger.exception("moving session %s during its tool wait failed", move.session_id)
            with self._moves_done:
                self._num_moves_run += 1
                self._moves_done.notify_all()

    def _move_in_tool_wait(self, move: _ToolWaitMove) -> None:
        """Decide under the lock, move off it (the session's next turn waits for the move),
        record under it."""
        with self._lock:
            source = self._placed_on(move.session_id)
            if self._closed or source is None or self._handles.get(move.handle) is None:
                return  # its next turn came first (it adopted the handle), or it ended
            target = self.policy.choose_move(move.session_id, self._loads())
            if target is None or target == source:
                return
            done = self._moving[move.session_id] = threading.Event()
        num_held = 0
        try:
            _, num_held = self._move_held(move.handle, source, target, keep_on_failure=True)
        finally:
            with self._lock:
                if num_held:
                    self.policy.place(move.session_id, target)
                    self._set_placement(move.session_id, target)
                    self.migrations.append(
                        Migration(move.session_id, source, target, num_held, True)
                    )
                del self._moving[move.session_id]
            done.set()

    def _queue_move(self, move: _ToolWaitMove) -> None:
        """From a stream's finish callback (a replica's loop thread): never blocks for long."""
        with self._moves_done:
            self._num_moves_queued += 1
        self._moves.put(move)

    def flush_moves(self, timeout: float = 60.0) -> bool:
        """Wait until the tool-wait moves queued so far are done; False on timeout."""
        with self._moves_done:
            target = self._num_moves_queued
            return self._moves_done.wait_for(lambda: self._num_moves_run >= target, timeout)

    # ---- held KV and the rest of the backend interface -----------------------------------

    def _replica_of(self, handle: str) -> Engine | None:
        """The replica holding ``handle`` (lock-free: dict reads are atomic)."""
        session_id = self._handles.get(handle)
        replica = self._home.get(session_id) if session_id is not None else None
        return self.replicas[replica] if replica is not None else None

    def abort(self, request_id: str) -> None:
        for engine in self.replicas:  # a no-op where the request is not live
            engine.abort(request_id)

    def fork_held(self, handle: str, num_forks: int) -> list[str]:
        """Forks on the replica holding ``handle``; each fork is a session placed beside it."""
        with self._lock:
            session_id = self._handles.get(handle)
            replica = self._home.get(session_id) if session_id is not None else None
        if replica is None:
            return []
        new_handles = self.replicas[replica].fork_held(handle, num_forks)
        with self._lock:
            for new in new_handles:
                self._handles[new] = new  # a fork starts a session, named by its handle
                self.policy.place(new, replica)
                self._set_placement(new, replica)
        return new_handles

    def release_held_soon(self, handle: str, drop_cached: bool = False) -> None:
        engine = self._replica_of(handle)
        self._handles.pop(handle, None)
        if engine is not None:
            engine.release_held_soon(handle, drop_cached)

    def release_held_eventually(self, handle: str) -> None:
        engine = self._replica_of(handle)
        self._handles.pop(handle, None)
        if engine is not None:
            engine.release_held_eventually(handle)

    def pin_held_soon(self, handle: str, pinned: bool = True) -> None:
        engine = self._replica_of(handle)
        if engine is not None:
            engine.pin_held_soon(handle, pinned)

    def has_pending_controls(self) -> bool:
        """Whether a replica still has a queued release or pin unapplied."""
        return any(e.has_pending_controls() for e in self.replicas if not e.is_dead)

    def stats(self) -> EngineStats:
        """The replicas' counters summed (``kv_usage``: their mean)."""
        per = [engine.stats() for engine in self.replicas if not engine.is_dead]
        summed = {f.name: sum(getattr(s, f.name) for s in per) for f in fields(EngineStats)}
        summed["kv_usage"] = summed["kv_usage"] / max(1, len(per))
        return EngineStats(**summed)

    def capabilities(self) -> EngineCapabilities:
        """A replica's, plus session affinity when the policy keeps sessions home."""
        caps = self.replicas[0].capabilities()
        sticky = isinstance(self.policy, StickySessionPolicy)
        return replace(caps, name="agentx-router", session_affinity=sticky)

    def get_num_live_requests(self) -> int:
        return sum(engine.get_num_live_requests() for engine in self.replicas)

    @property
    def closed(self) -> bool:
        return self._closed

    def get_stats(self) -> RouterStats:
        with self._lock:
            return RouterStats(
                num_replicas=len(self.replicas),
                num_dead_replicas=sum(engine.is_dead for engine in self.replicas),
                num_migrations=len(self.migrations),
                num_moved_sessions=self.num_moved_sessions,
                num_tool_wait_migrations=sum(m.during_tool_wait for m in self.migrations),
            )

    def end_session(self, session_id: str) -> None:
        with self._lock:
            self.policy.forget(session_id)
            self._home.pop(session_id, None)
            for sessions in self._sessions:
                sessions.discard(session_id)

    def check_integrity(self) -> None:
        """Every replica's own check; a session placed on one replica at most; the policy's
        state agrees with the placement."""
        with self._lock:
            placement: dict[str, int] = {}
            for r, sessions in enumerate(self._sessions):
                for session_id in sessions:
                    assert session_id not in placement, f"{session_id} is on two replicas"
                    placement[session_id] = r
            assert placement == self._home, "the session index drifted from the placement"
            self.policy.check_integrity(placement)
            self.prefix_index.check_integrity()
        for engine in self.replicas:
            if not engine.is_dead:  # a crashed loop may have left its state half-stepped
                engine.check_integrity()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if hasattr(self, "_moves"):
                self._moves.put(None)  # the mover ends after the moves queued before
        for engine in self.replicas:
            engine.close()


def _held_kv(options: dict) -> str | None:
    """The held KV handle a request's options name (a keyword or ``options.held_kv``)."""
    return options.get("held_kv") or getattr(options.get("options"), "held_kv", None)


__all__ = [
    "POLICIES",
    "LeastLoadedPolicy",
    "Migration",
    "PrefixIndex",
    "ReplicaLoad",
    "ReplicaRouter",
    "RoundRobinPolicy",
    "RouterPolicy",
    "RouterStats",
    "StickySessionPolicy",
    "has_shared_tier",
    "least_loaded",
]
