"""Token-budget scheduling: one budget per step, policies as queue types."""

from agentx.engine.scheduler.queues import QUEUES, FCFSQueue, PriorityQueue, RequestQueue
from agentx.engine.scheduler.scheduler import Scheduler, make_output

__all__ = ["QUEUES", "FCFSQueue", "PriorityQueue", "RequestQueue", "Scheduler", "make_output"]
