"""Retention: which block boundaries of a sequence are worth a checkpoint.

A linear-attention (or SSM) layer has one recurrent state per sequence; a prefix can be resumed
only from a state saved exactly at its end. Saving every boundary costs a page per block, so a
policy picks the boundaries when a request is admitted. The same policies are meant for every
tier (device now; the offload tiers reuse them).

    IntervalRetention(N)   the prompt-end boundary of each turn, plus every N tokens;
                           N = 0: only the latest boundary reached (rolling)
    MarconiRetention       the branch point: the deepest prompt boundary whose prefix an earlier
                           request already had (a shared prefix is checkpointed the second time
                           it is seen), plus the rolling latest boundary (the next turn's start)
    NoRetention            nothing beyond the running state (the baseline: no hits)

Each is a :class:`~agentx.engine.kv_cache.policy.KVPolicy` that overrides only
``plan_checkpoints``: its other hooks are the built-in defaults, and a custom policy can
subclass one to keep its retention and change the rest.
"""

from __future__ import annotations

from abc import abstractmethod
from collections import OrderedDict

from agentx.engine.block_hash import BlockHash
from agentx.engine.kv_cache.policy import CheckpointPlan, KVPolicy
from agentx.engine.request import Request


class RetentionPolicy(KVPolicy):
    """Plans a request's checkpoints when it is first given blocks.

    ``plan`` may update the policy's own memory of what it has seen (it is called once per
    admission, from the engine step); it never touches the pool.
    """

    name: str

    @abstractmethod
    def plan(self, request: Request, block_size: int) -> CheckpointPlan: ...

    def plan_checkpoints(self, request: Request, block_size: int) -> CheckpointPlan:
        return self.plan(request, block_size)


class NoRetention(RetentionPolicy):
    name = "none"

    def plan(self, request: Request, block_size: int) -> CheckpointPlan:
        return CheckpointPlan()


class IntervalRetention(RetentionPolicy):
    def __init__(self, interval: int = 0) -> None:
        if interval < 0:
            raise ValueError(f"retention interval must be >= 0, got {interval}")
        self.interval = interval
        self.name = f"interval({interval})"

    def plan(self, request: Request, block_size: int) -> CheckpointPlan:
        if self.interval == 0:
            return CheckpointPlan(rolling=True)
        # checkpoints sit on block boundaries: a hybrid layout may have raised the block size
        # past the configured interval, which then rounds up to a multiple of it
        every = -(-self.interval // block_size) * block_size
        prompt_end = request.num_prompt_tokens // block_size * block_size
        fixed = frozenset({prompt_end}) if prompt_end else frozenset()
        return CheckpointPlan(fixed=fixed, every=every)


class MarconiRetention(RetentionPolicy):
    """Selective admission: remember the block hashes of recent prompts (bounded LRU); a
    request's deepest prompt boundary already seen is a branch point worth a checkpoint."""

    name = "marconi"

    def __init__(self, max_seen: int = 1 << 16) -> None:
        self.max_seen = max_seen
        self._seen: OrderedDict[BlockHash, None] = OrderedDict()

    def plan(self, request: Request, block_size: int) -> CheckpointPlan:
        num_prompt_blocks = request.num_prompt_tokens // block_size
        hashes = request.block_hashes[:num_prompt_blocks]
        branch = 0
        for i, block_hash in enumerate(hashes):
            if block_hash in self._seen:
                branch = (i + 1) * block_size
        for block_hash in hashes:
            self._seen[block_hash] = None
            self._seen.move_to_end(block_hash)
        while len(self._seen) > self.max_seen:
            self._seen.popitem(last=False)
        return CheckpointPlan(fixed=frozenset({branch}) if branch else frozenset(), rolling=True)


def make_retention(name: str, interval: int = 0) -> RetentionPolicy:
    policies = {
        "interval": lambda: IntervalRetention(interval),
        "marconi": MarconiRetention,
        "none": NoRetention,
    }
    if name not in policies:
        raise ValueError(f"unknown retention policy {name!r}; choose one of {sorted(policies)}")
    return policies[name]()


__all__ = [
    "CheckpointPlan",
    "IntervalRetention",
    "MarconiRetention",
    "NoRetention",
    "RetentionPolicy",
    "make_retention",
]
