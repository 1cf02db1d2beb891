"""Spawning worker processes from a script that has no ``if __name__ == "__main__":`` guard.

A spawned child re-imports the caller's main module (as ``__mp_main__``) before it runs its
target. A script that builds a multi-process engine at module level builds it again inside
every child, which then tries to spawn its own workers mid-bootstrap and dies: the parent saw
only "worker rank 0 closed its pipe". Now the child notices it is still bootstrapping
(``refuse_spawn_while_bootstrapping``), prints why and exits with ``UNGUARDED_MAIN_EXIT``; the
parent turns that exit code into an error that says to add the guard (``unguarded_main_error``).
"""

from __future__ import annotations

import multiprocessing
import sys

from agentx.errors import EngineDeadError

__all__ = ["UNGUARDED_MAIN_EXIT", "refuse_spawn_while_bootstrapping", "unguarded_main_error"]

UNGUARDED_MAIN_EXIT = 78  # EX_CONFIG (sysexits.h)

_ADVICE = (
    "the script builds a multi-process engine (ParallelConfig tp/dcp/ep > 1, or P/D "
    "disaggregation) at module level: worker processes are spawned and re-import the main "
    'module, so build the engine under `if __name__ == "__main__":` (or in a function called '
    "from there)"
)


def refuse_spawn_while_bootstrapping() -> None:
    """Call before spawning: in a child still importing the parent's main module, print why
    and exit with ``UNGUARDED_MAIN_EXIT`` (the parent reports it)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        print(f"agentx: {_ADVICE}", file=sys.stderr, flush=True)
        raise SystemExit(UNGUARDED_MAIN_EXIT)


def unguarded_main_error(exitcode: int | None, who: str) -> EngineDeadError | None:
    """The parent's error for a child that exited with ``UNGUARDED_MAIN_EXIT``; else None."""
    if exitcode != UNGUARDED_MAIN_EXIT:
        return None
    return EngineDeadError(f"{who} exited while importing the main module: {_ADVICE}")
