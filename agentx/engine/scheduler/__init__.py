"""Token-budget scheduling: one budget per step, policies as queue types, step cost models."""

from agentx.engine.scheduler.queues import QUEUES, FCFSQueue, PriorityQueue, RequestQueue
from agentx.engine.scheduler.scheduler import Scheduler, make_output
from agentx.engine.scheduler.step_clock import PrefillCadence, StepClock
from agentx.engine.scheduler.step_cost import (
    STEP_COST_MODELS,
    AdaptiveStepCost,
    FixedStepCost,
    StepCost,
    StepCostModel,
    make_step_cost,
)

__all__ = [
    "QUEUES",
    "STEP_COST_MODELS",
    "AdaptiveStepCost",
    "FCFSQueue",
    "FixedStepCost",
    "PrefillCadence",
    "PriorityQueue",
    "RequestQueue",
    "Scheduler",
    "StepClock",
    "StepCost",
    "StepCostModel",
    "make_output",
    "make_step_cost",
]
