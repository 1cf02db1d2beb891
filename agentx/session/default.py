"""The process-wide default engine, created on first use and shared by every Session."""

from __future__ import annotations

import atexit
import threading

from agentx.engine.client import Engine

_lock = threading.Lock()
_engine: Engine | None = None


def get_default_engine() -> Engine:
    """The shared engine on the embedded default model (loaded once, closed at exit)."""
    global _engine
    with _lock:
        if _engine is None or _engine.closed:
            _engine = Engine()
            atexit.register(_engine.close)
        return _engine
