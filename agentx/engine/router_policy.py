"""Router policies: which replica a request goes to, and the prefix index they consult.

A policy sees one :class:`ReplicaLoad` per replica and answers with an index; it keeps its own
state (the sticky policy: each session's home) and mutates nothing else. The router
(``router.py``) owns the replicas, the locks and the moving of KV; this module knows nothing
about engines.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from agentx.engine.block_hash import BlockHash, extend_block_hashes, salt_key
from agentx.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a policy sees of one replica when it chooses."""

    num_live_requests: int
    num_sessions: int  # sessions whose KV the router last placed here
    # leading tokens of this request that the router last sent here in some prompt (whole
    # blocks; an estimate of the prefix hit there: the replica may have evicted them since)
    num_cached_tokens: int = 0
    alive: bool = True  # False: the replica's loop crashed; never choose it


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

    def place(self, session_id: str, replica: int) -> None:  # noqa: B027
        """The router placed ``session_id`` on ``replica`` itself (a fork beside its parent, a
        session moved during its tool wait): keep it there as ``choose`` would have."""

    def choose_move(self, session_id: str, loads: Sequence[ReplicaLoad]) -> int | None:
        """A session waits on a long tool call: the replica to move it (and its KV) to now, or
        None to leave it home. Asked only of a policy that ``migrates_kv``; it must not change
        the policy's state (the router calls ``place`` once the move is done)."""
        return None

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

    def choose_move(self, session_id: str, loads: Sequence[ReplicaLoad]) -> int | None:
        """The least-loaded replica when the session's home has more than ``migrate_after``
        live requests more (the rule ``choose`` applies when its next turn is routed)."""
        home = self.home.get(session_id)
        if self.migrate_after is None or home is None or not loads[home].alive:
            return None
        best = least_loaded(loads)
        excess = loads[home].num_live_requests - loads[best].num_live_requests
        return best if excess > self.migrate_after else None

    def place(self, session_id: str, replica: int) -> None:
        self.home[session_id] = replica

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


__all__ = [
    "POLICIES",
    "LeastLoadedPolicy",
    "PrefixIndex",
    "ReplicaLoad",
    "RoundRobinPolicy",
    "RouterPolicy",
    "StickySessionPolicy",
    "least_loaded",
]
