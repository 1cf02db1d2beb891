"""Parallel state and collectives (``state.py``: below the models, which take a ParallelState),
and the executors that run the model over worker processes (``executor.py``, ``multiproc.py``,
``worker.py``: above the runner, imported by the engine core, never from here)."""

from agentx.engine.parallel.prefill_split import PrefillSplit, zigzag_rows
from agentx.engine.parallel.state import SINGLE, HeadShard, ParallelState

__all__ = ["SINGLE", "HeadShard", "ParallelState", "PrefillSplit", "zigzag_rows"]
