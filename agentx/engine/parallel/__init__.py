"""Parallel state and collectives (world size 1 today; tensor / context parallel build on it)."""

from agentx.engine.parallel.state import SINGLE, HeadShard, ParallelState

__all__ = ["SINGLE", "HeadShard", "ParallelState"]
