"""Data-parallel replicas behind a session router, in the caller's process.

    ReplicaRouter.add_request(prompt, session_id=...)
        -> RouterPolicy.choose(session_id, loads) -> replica r -> replicas[r].add_request(...)

Each replica is a whole :class:`Engine` (its own scheduler, KV pool and, with tp > 1, its own
worker processes). A session's KV lives on the replica that ran its last turn, so the policy
that wins agent traffic is sticky: a session stays where its KV is; a first turn (cold, often
long) goes to the least-loaded replica. Round-robin and least-loaded are the baselines the
benchmarks compare it with. Not built yet: migrating a waiting session's KV off an overloaded
replica (export / import through a shared tier) and aligning ``prefill_schedule_interval``
across replicas.
"""

from __future__ import annotations

import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace

from agentx.config import EngineConfig
from agentx.engine.client import Engine, Prompt
from agentx.engine.sampling import SamplingParams
from agentx.engine.streams import RequestStream
from agentx.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a policy sees of one replica when it chooses."""

    num_live_requests: int
    num_sessions: int  # sessions whose KV the router last placed here


class RouterPolicy(ABC):
    """Chooses a replica per request. Called under the router's lock, one call at a time; it may
    keep its own state (which replica holds which session) and mutates nothing else."""

    @abstractmethod
    def choose(self, session_id: str | None, loads: Sequence[ReplicaLoad]) -> int:
        """The replica index for a request of ``session_id`` (None: no session)."""

    def forget(self, session_id: str) -> None:  # noqa: B027 - most policies keep no sessions
        """The session ended: drop what the policy keeps for it."""


def least_loaded(loads: Sequence[ReplicaLoad]) -> int:
    """Fewest live requests, then fewest sessions, then the lowest index."""
    return min(range(len(loads)), key=lambda r: (loads[r].num_live_requests, loads[r].num_sessions))


class RoundRobinPolicy(RouterPolicy):
    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, session_id: str | None, loads: Sequence[ReplicaLoad]) -> int:
        return next(self._next) % len(loads)


class LeastLoadedPolicy(RouterPolicy):
    def choose(self, session_id: str | None, loads: Sequence[ReplicaLoad]) -> int:
        return least_loaded(loads)


class StickySessionPolicy(RouterPolicy):
    """A session's turns go where its first turn went; first turns to the least loaded."""

    def __init__(self) -> None:
        self.home: dict[str, int] = {}

    def choose(self, session_id: str | None, loads: Sequence[ReplicaLoad]) -> int:
        if session_id is not None and session_id in self.home:
            return self.home[session_id]
        replica = least_loaded(loads)
        if session_id is not None:
            self.home[session_id] = replica
        return replica

    def forget(self, session_id: str) -> None:
        self.home.pop(session_id, None)


POLICIES: dict[str, type[RouterPolicy]] = {
    "sticky": StickySessionPolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
}


class ReplicaRouter:
    """``config.parallel.dp`` engine replicas (each built with dp=1) and a routing policy."""

    def __init__(self, config: EngineConfig, policy: str | RouterPolicy = "sticky") -> None:
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ConfigError(f"router policy must be one of {sorted(POLICIES)}: {policy!r}")
            policy = POLICIES[policy]()
        self.policy = policy
        one = replace(config, parallel=replace(config.parallel, dp=1))
        self.replicas: list[Engine] = []
        try:
            for _ in range(config.parallel.dp):
                self.replicas.append(Engine(one))
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()
        self._sessions: list[set[str]] = [set() for _ in self.replicas]
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
        the sticky policy keeps it there."""
        with self._lock:
            loads = [
                ReplicaLoad(engine.get_num_live_requests(), len(sessions))
                for engine, sessions in zip(self.replicas, self._sessions, strict=True)
            ]
            replica = self.policy.choose(session_id, loads)
            if session_id is not None:
                for r, sessions in enumerate(self._sessions):
                    (sessions.add if r == replica else sessions.discard)(session_id)
        return replica, self.replicas[replica].add_request(prompt, sampling, **options)

    def end_session(self, session_id: str) -> None:
        with self._lock:
            self.policy.forget(session_id)
            for sessions in self._sessions:
                sessions.discard(session_id)

    def close(self) -> None:
        for engine in self.replicas:
            engine.close()

    def __enter__(self) -> ReplicaRouter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
