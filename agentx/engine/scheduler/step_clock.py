"""When new prefills may start: ``prefill_schedule_interval`` windows over a step index that
one engine owns or that data-parallel replicas share.

    interval 3, one engine:       steps 0 1 2 3 4 5 6 ...   admits at 0, 3, 6 (while decoding)
    interval 3, shared StepClock: replica A  0 1 2 3 4 5
                                  replica B  0 1   3 4 5    (B idled at step 2: it rejoins at 3)
                                  both admit at 0 and 3: the same windows

A window is ``index // interval``; a step may admit new prefills when it is the first step of
its window that this scheduler takes (with consecutive indices: ``index % interval == 0``).
DP ranks that step in lockstep (one collective per step) stall on their slowest rank, so a
prefill on one rank slows every rank's step; aligned windows put the ranks' prefills in the
same steps. In-process replicas run their own loops and wait on no one, so here alignment
keeps the cadence a lockstep deployment would see (one phase for all replicas, also for a
replica that was idle) rather than buying speed by itself.
"""

from __future__ import annotations

import threading

__all__ = ["PrefillCadence", "StepClock"]


class StepClock:
    """A step index shared by replicas (thread-safe). A replica's next step takes the current
    shared index, or the one after its own previous step if that is later: replicas stepping
    in turn (A, B, A, B) number their steps alike (0, 0, 1, 1), and a replica back from idle
    joins the current index as a lockstep rank that stepped empty batches would."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._index = -1

    def next_index(self, previous: int) -> int:
        """The index of a step that follows a step numbered ``previous`` (-1: the first)."""
        with self._lock:
            self._index = max(self._index, previous + 1)
            return self._index

    def get_index(self) -> int:
        """The latest index handed out (-1: none yet). No side effects."""
        with self._lock:
            return self._index


class PrefillCadence:
    """One scheduler's prefill windows. ``tick`` is called once per scheduled step; it numbers
    the step (``index``) and says whether it opens a window."""

    def __init__(self, interval: int, clock: StepClock | None = None) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval}")
        self.interval = interval
        self.clock = clock
        self.index = -1  # the index of the latest step

    def tick(self) -> bool:
        previous = self.index
        self.index = previous + 1 if self.clock is None else self.clock.next_index(previous)
        return previous < 0 or self.index // self.interval != previous // self.interval
