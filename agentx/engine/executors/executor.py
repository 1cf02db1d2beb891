"""Executor: what the engine core asks of whatever runs the model, in one process or many.

    EngineCore --SchedulerOutput--> Executor --ModelRunnerOutput--> EngineCore

At world size 1 the executor is the :class:`ModelRunner` itself (in the caller's process, no
copies). Above it, :class:`MultiprocExecutor` (``multiproc.py``) starts one worker process per
rank, each with its own runner and its shard of the weights and KV cache, and forwards every
call to all of them. The scheduler and the KV manager stay in the caller's process either way:
block ids mean the same tokens on every rank.

This module and ``multiproc.py`` / ``worker.py`` sit above ``runner`` (they build runners);
``state.py`` sits below ``models`` (layers take a :class:`ParallelState`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from agentx.config import EngineConfig
from agentx.engine.kv_cache import BlockCopy, KVCacheLayout
from agentx.engine.models.loader import Checkpoint
from agentx.engine.models.spec import ModelSpec
from agentx.engine.outputs import GrammarMasks, ModelRunnerOutput, SchedulerOutput
from agentx.engine.parallel.state import ParallelState
from agentx.engine.runner import ModelRunner
from agentx.errors import ConfigError


class Executor(ABC):
    """Runs the model for the engine core. Every method is called from the engine loop thread
    (or under the engine's step lock), one at a time, in the order the core issues them.

    A failure that leaves the model unusable (a worker died, a rank raised) raises
    :class:`~agentx.errors.EngineDeadError` from then on; it never hangs.
    """

    layout: KVCacheLayout  # the KV pool the scheduler plans: same block ids on every rank
    max_model_len: int
    spec: ModelSpec

    @property
    @abstractmethod
    def page_bytes(self) -> int:
        """Bytes of one block id across every slot and every rank holding a different part of
        it (ranks that replicate the KV, as under expert parallel, count once): one offload
        page."""

    @abstractmethod
    def execute(self, out: SchedulerOutput, masks: GrammarMasks | None = None) -> ModelRunnerOutput:
        """Run one step: write its KV, sample the tokens of the requests that sample."""

    @abstractmethod
    def forget(self, request_ids: frozenset[str]) -> None:
        """Drop the state of requests that ended."""

    @abstractmethod
    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy whole blocks (every layer, every rank) for copy-on-write forks."""

    @abstractmethod
    def gather_pages(self, block_ids: list[int]) -> torch.Tensor:
        """(n, page_bytes) uint8 host copies of the blocks."""

    @abstractmethod
    def scatter_pages(self, block_ids: list[int], pages: torch.Tensor) -> None:
        """Write (n, page_bytes) host pages into the blocks."""

    @abstractmethod
    def warm_up(self) -> None:
        """One small forward outside the scheduler, before the first step."""

    @abstractmethod
    def get_request_ids(self) -> set[str]:
        """Requests the runner keeps state for (``EngineCore.check_integrity``)."""

    @abstractmethod
    def close(self) -> None:
        """Stop whatever the executor started; idempotent, never raises for a dead worker."""


Executor.register(ModelRunner)


def make_executor(config: EngineConfig, checkpoint: Checkpoint) -> Executor:
    """The in-process runner at world size 1, else worker processes (which load the
    checkpoint themselves: the caller keeps only its tokenizer and spec)."""
    if config.parallel.world_size == 1:
        return ModelRunner(config, checkpoint.spec, checkpoint.weights)
    spec, tp, ep = checkpoint.spec, config.parallel.tp, config.parallel.ep
    for rank in range(tp):  # a ConfigError here, before any process starts
        ParallelState(rank, tp).head_shard(spec.num_heads, spec.num_kv_heads)
    if ep > 1:
        num_experts = getattr(spec.arch_config, "num_experts", 0)
        if not num_experts:
            raise ConfigError(f"parallel.ep={ep} needs a mixture-of-experts model")
        ParallelState(ep_size=ep).expert_shard(num_experts)
    from agentx.engine.executors.multiproc import MultiprocExecutor  # it imports this module

    return MultiprocExecutor(config, checkpoint.spec)
