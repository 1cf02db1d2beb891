"""Waiting for an engine's loop to go idle: every request ended, every queued control applied."""

import time


def wait_idle(engine, timeout: float = 30.0):
    """The engine's stats once no request runs, waits or is live and every release, pin or
    abort queued before the wait has been applied.

    Controls are checked before the stats are read: the loop takes the queue before it
    applies it, so only ``has_pending_controls()`` (False once they are applied) makes the
    stats that follow show them. Backends without it (vLLM, the P/D coordinator) are judged
    by their requests alone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pending = getattr(engine, "has_pending_controls", None)
        if pending is None or not pending():
            stats = engine.stats()
            live = engine.get_num_live_requests()
            if stats.num_running == stats.num_waiting == live == 0:
                return stats
        time.sleep(0.02)
    raise AssertionError("engine did not go idle")
