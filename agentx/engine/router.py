"""Data-parallel replicas behind a session router, in the caller's process.

    ReplicaRouter.add_request(prompt, session_id=...)
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

Prefill windows: with ``prefill_schedule_interval`` N > 1 the replicas share one
:class:`StepClock` (``align_prefills``), so they open their prefill windows on the same step
indices, as DP ranks that step in lockstep would (scheduler/step_clock.py says what that buys
in-process).

Replicas run in one process. ``torch.set_num_threads`` acts on the calling thread (OpenMP): a
replica sets its ``num_threads`` on the thread that builds it, and the loop thread it starts
then runs with that count (tests/test_router.py: two replicas at 1 thread each, the caller's
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
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from agentx.config import EngineConfig, OffloadConfig
from agentx.engine.backend import Prompt
from agentx.engine.block_hash import BlockHash, extend_block_hashes, salt_key
from agentx.engine.client import Engine
from agentx.engine.sampling import SamplingParams
from agentx.engine.scheduler import StepClock
from agentx.engine.streams import RequestStream
from agentx.errors import ConfigError, EngineDeadError


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a policy sees of one replica when it chooses."""

    num_live_requests: int
    num_sessions: int  # sessions whose KV the router last placed here
    # leading tokens of this request that the router last sent here in some prompt (whole
    # blocks; an estimate of the prefix hit there: the replica may have evicted them since)
    num_cached_tokens: int = 0
    alive: bool = True  # False: the replica's loop crashed; never choose it


@dataclass(frozen=True, slots=True)
class RouterStats:
    num_replicas: int
    num_dead_replicas: int
    num_migrations: int  # sessions moved with their KV off a live, overloaded home
    num_moved_sessions: int  # sessions moved off a dead home (their held KV lost)


class PrefixIndex:
    """The prompt prefixes the router sent to each replica, as chained hashes of whole
    ``block_tokens``-token blocks (a block's hash covers every token before it, as the engine's
    prefix hashes do, and the request's cache salt): at most ``max_blocks`` per replica, the
    least recently sent dropped first. Lives under the router's lock."""

    def __init__(self, num_replicas: int, block_tokens: int, max_blocks: int = 1 << 16) -> None:
        if max_blocks <= 0:
            raise ConfigError(f"the prefix index needs max_blocks > 0, got {max_blocks}")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._blocks: list[OrderedDict[BlockHash, None]] = [
            OrderedDict() for _ in range(num_replicas)
        ]

    def hashes(self, token_ids: Sequence[int], salt: str | None = None) -> list[BlockHash]:
        """One chained hash per whole block of ``token_ids``: the engine's own block hashes
        (block_hash.py) when ``block_tokens`` is the replicas' block size."""
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, token_ids, self.block_tokens, salt_key(salt))
        return hashes

    def matched_tokens(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Per replica, how many leading tokens (whole blocks) it was sent."""
        matched = []
        for blocks in self._blocks:
            n = 0
            while n < len(hashes) and hashes[n] in blocks:
                n += 1
            matched.append(n * self.block_tokens)
        return matched

    def record(self, replica: int, hashes: Sequence[BlockHash]) -> None:
        """``replica`` was sent a prompt with these block hashes: they are its newest."""
        blocks = self._blocks[replica]
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def num_blocks(self, replica: int) -> int:
        return len(self._blocks[replica])

    def check_integrity(self) -> None:
        for r, blocks in enumerate(self._blocks):
            assert len(blocks) <= self.max_blocks, f"replica {r}'s index is over its cap"


class RouterPolicy(ABC):
    """Chooses a replica per request. Called under the router's lock, one call at a time; it may
    keep its own state (which replica holds which session) and mutates nothing else.

    ``migrates_kv``: when ``choose`` sends a session somewhere other than where the router last
    placed it, the router moves the session's KV there through the shared tier. False: a moved
    session recomputes its prefix on the new replica (the baselines do that).
    """

    migrates_kv: bool = False

    @abstractmethod
    def choose(self, session_id: str | None, loads: Sequence[ReplicaLoad]) -> int:
        """The replica index for a request of ``session_id`` (None: no session)."""

    def forget(self, session_id: str) -> None:  # noqa: B027 - most policies keep no sessions
        """The session ended: drop what the policy keeps for it."""

    def check_integrity(self, placement: dict[str, int]) -> None:  # noqa: B027
        """Raise AssertionError if what the policy keeps disagrees with ``placement`` (session
        -> the replica the router last sent it to)."""


def least_loaded(loads: Sequence[ReplicaLoad]) -> int:
    """The live replica with the fewest live requests, then fewest sessions, then the lowest
    index (a dead replica has no load: it would always look least loaded)."""
    live = [r for r in range(len(loads)) if loads[r].alive] or range(len(loads))
    return min(live, key=lambda r: (loads[r].num_live_requests, loads[r].num_sessions))


class RoundRobinPolicy(RouterPolicy):
    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, session_id: str | None, loads: Sequence[ReplicaLoad]) -> int:
        for _ in range(len(loads)):  # skips dead replicas
            replica = next(self._next) % len(loads)
            if loads[replica].alive:
                return replica
        return replica


class LeastLoadedPolicy(RouterPolicy):
    def choose(self, session_id: str | None, loads: Sequence[ReplicaLoad]) -> int:
        return least_loaded(loads)


class StickySessionPolicy(RouterPolicy):
    """A session's turns go where its first turn went; first turns to the replica that holds
    the longest prefix of their prompt, else to the least loaded.

    ``migrate_after=k``: a session whose home has more than ``k`` live requests more than the
    least-loaded replica moves there (its new home), its KV with it. None: never moves.
    ``prefix_min_tokens``: a first turn goes to the replica the router sent the longest prefix
    of its prompt to when that prefix has at least this many tokens and that replica has at most
    ``prefix_load_slack`` live requests more than the least loaded (None: always the least
    loaded, the placement of a plain sticky router).
    """

    def __init__(
        self,
        migrate_after: int | None = None,
        *,
        prefix_min_tokens: int | None = 64,
        prefix_load_slack: int = 4,
    ) -> None:
        if migrate_after is not None and migrate_after < 0:
            raise ConfigError(f"migrate_after must be >= 0 or None, got {migrate_after}")
        if prefix_min_tokens is not None and prefix_min_tokens <= 0:
            raise ConfigError(f"prefix_min_tokens must be > 0 or None, got {prefix_min_tokens}")
        if prefix_load_slack < 0:
            raise ConfigError(f"prefix_load_slack must be >= 0, got {prefix_load_slack}")
        self.migrate_after = migrate_after
        self.migrates_kv = migrate_after is not None
        self.prefix_min_tokens = prefix_min_tokens
        self.prefix_load_slack = prefix_load_slack
        self.home: dict[str, int] = {}

    def choose(self, session_id: str | None, loads: Sequence[ReplicaLoad]) -> int:
        if session_id in self.home and not loads[self.home[session_id]].alive:
            del self.home[session_id]  # its home died: placed again, as a first turn
        if session_id is not None and session_id in self.home:
            home = self.home[session_id]
            if self.migrate_after is None:
                return home
            best = least_loaded(loads)
            excess = loads[home].num_live_requests - loads[best].num_live_requests
            if excess > self.migrate_after:
                self.home[session_id] = best
                return best
            return home
        replica = self._first_turn(loads)
        if session_id is not None:
            self.home[session_id] = replica
        return replica

    def _first_turn(self, loads: Sequence[ReplicaLoad]) -> int:
        idle = least_loaded(loads)
        if self.prefix_min_tokens is None:
            return idle
        warm = max(
            [r for r in range(len(loads)) if loads[r].alive] or range(len(loads)),
            key=lambda r: (loads[r].num_cached_tokens, -loads[r].num_live_requests, -r),
        )
        cached = loads[warm].num_cached_tokens
        busier = loads[warm].num_live_requests - loads[idle].num_live_requests
        if cached >= self.prefix_min_tokens and busier <= self.prefix_load_slack:
            return warm
        return idle

    def forget(self, session_id: str) -> None:
        self.home.pop(session_id, None)

    def check_integrity(self, placement: dict[str, int]) -> None:
        assert self.home == placement, f"homes drifted from placement: {self.home} {placement}"


POLICIES: dict[str, type[RouterPolicy]] = {
    "sticky": StickySessionPolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
}


@dataclass(frozen=True, slots=True)
class Migration:
    """A session the router moved, with its KV, from one replica to another."""

    session_id: str
    source: int
    target: int
    num_held_tokens: int  # tokens of held KV imported on the target (0: the prefix cache only)


def has_shared_tier(offload: OffloadConfig) -> bool:
    """Do replicas built from one ``offload`` config read one tier? A disk folder, or a running
    Mooncake master; not ``mooncake="auto"`` (each replica would start its own master)."""
    return offload.disk_path is not None or offload.mooncake not in (None, "auto")


class ReplicaRouter:
    """``config.parallel.dp`` engine replicas (each built with dp=1) and a routing policy.

    ``align_prefills``: the replicas share one StepClock, so ``prefill_schedule_interval``
    opens their prefill windows on the same step indices. ``prefix_index_blocks``: the prefix
    index's cap per replica (whole blocks). Raises ConfigError for an unknown policy name, or a
    policy that migrates KV without a tier the replicas share.
    """

    def __init__(
        self,
        config: EngineConfig,
        policy: str | RouterPolicy = "sticky",
        *,
        align_prefills: bool = True,
        prefix_index_blocks: int = 1 << 16,
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
        self.migrations: list[Migration] = []
        self.num_moved_sessions = 0  # off a dead replica
        self.tokenizer = self.replicas[0].tokenizer

    def add_request(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        session_id: str | None = None,
        **options,
    ) -> tuple[int, RequestStream]:
        """Route and queue a request; the replica chosen and the request's stream. A session's
        ``held_kv`` handle (``Engine.add_request``) only means something on its own replica:
        the sticky policy keeps it there, and a migration replaces it with the handle of the
        KV imported on the new replica."""
        token_ids = self.replicas[0].tokenize(prompt)  # also refuses a bad prompt, unrouted
        salt = options.get("cache_salt") or getattr(options.get("options"), "cache_salt", None)
        hashes = self.prefix_index.hashes(token_ids, salt)  # pure: outside the lock
        with self._lock:
            cached = self.prefix_index.matched_tokens(hashes)
            loads = [
                ReplicaLoad(
                    engine.get_num_live_requests(), len(sessions), n, alive=not engine.is_dead
                )
                for engine, sessions, n in zip(self.replicas, self._sessions, cached, strict=True)
            ]
            if not any(load.alive for load in loads):
                raise EngineDeadError("every replica of the router is dead")
            source = self._placed_on(session_id)
            replica = self.policy.choose(session_id, loads)
            if not loads[replica].alive:  # a policy that does not look at ``alive``
                replica = least_loaded(loads)
            if session_id is not None:
                if source is not None and not loads[source].alive:
                    options = self._move_off_dead(options)
                elif source is not None and source != replica and self.policy.migrates_kv:
                    options = self._migrate(session_id, source, replica, options)
                for r, sessions in enumerate(self._sessions):
                    (sessions.add if r == replica else sessions.discard)(session_id)
            self.prefix_index.record(replica, hashes)
        return replica, self.replicas[replica].add_request(token_ids, sampling, **options)

    def _placed_on(self, session_id: str | None) -> int | None:
        for r, sessions in enumerate(self._sessions):
            if session_id in sessions:
                return r
        return None

    def _move_off_dead(self, options: dict) -> dict:
        """A session whose home died: its held KV died with it (the request runs without it;
        its prefix loads from a shared tier when there is one, else is recomputed)."""
        self.num_moved_sessions += 1
        options = {**options, "held_kv": None}
        if options.get("options") is not None:
            options["options"] = replace(options["options"], held_kv=None)
        return options

    def get_stats(self) -> RouterStats:
        with self._lock:
            return RouterStats(
                num_replicas=len(self.replicas),
                num_dead_replicas=sum(engine.is_dead for engine in self.replicas),
                num_migrations=len(self.migrations),
                num_moved_sessions=self.num_moved_sessions,
            )

    def _migrate(self, session_id: str, source: int, target: int, options: dict) -> dict:
        """Make the session's KV on ``source`` loadable on ``target``; the request's options
        with ``held_kv`` naming the imported copy (when it named held KV)."""
        src, dst = self.replicas[source], self.replicas[target]
        request_options = options.get("options")
        handle = options.get("held_kv") or getattr(request_options, "held_kv", None)
        num_held = 0
        if handle is None:
            src.flush_offload()  # the prefix cache's blocks: the target's lookup loads them
        else:
            export = src.export_held(handle)  # waits for its stores, like flush_offload
            imported = dst.import_held(export) if export is not None else None
            if imported is not None:
                num_held = len(export.token_ids)
            src.release_held(handle)  # the session left: the tier (and the target) hold it
            options = {**options, "held_kv": imported}
            if request_options is not None:
                options["options"] = replace(request_options, held_kv=imported)
        self.migrations.append(Migration(session_id, source, target, num_held))
        return options

    def end_session(self, session_id: str) -> None:
        with self._lock:
            self.policy.forget(session_id)
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
            self.policy.check_integrity(placement)
            self.prefix_index.check_integrity()
        for engine in self.replicas:
            if not engine.is_dead:  # a crashed loop may have left its state half-stepped
                engine.check_integrity()

    def close(self) -> None:
        for engine in self.replicas:
            engine.close()

    def __enter__(self) -> ReplicaRouter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
