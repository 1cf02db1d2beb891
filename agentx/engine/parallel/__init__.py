"""Parallel state and collectives: below the models, which take a ParallelState. The executors
that run the model over worker processes sit above the runner, in :mod:`agentx.engine.executors`."""

from agentx.engine.parallel.prefill_split import PrefillSplit, zigzag_rows
from agentx.engine.parallel.state import SINGLE, HeadShard, ParallelState

__all__ = ["SINGLE", "HeadShard", "ParallelState", "PrefillSplit", "zigzag_rows"]
