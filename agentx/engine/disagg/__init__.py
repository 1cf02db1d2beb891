"""P/D disaggregation: prefill and decode instances in their own processes (coordinator.py)."""

from agentx.engine.disagg.coordinator import DisaggCoordinator, DisaggCounters
from agentx.engine.disagg.instance import EngineInstance

__all__ = ["DisaggCoordinator", "DisaggCounters", "EngineInstance"]
