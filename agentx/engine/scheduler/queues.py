"""Waiting queues: the order in which waiting requests are admitted, and who is preempted.

A policy is a queue type plus its choice of preemption victim among running requests.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from agentx.engine.request import Request


class RequestQueue(ABC):
    """Waiting requests. ``peek``/``pop`` return the next request to admit."""

    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def add_preempted(self, request: Request) -> None:
        """Re-queue a preempted request so it is admitted before later arrivals."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    @staticmethod
    @abstractmethod
    def pick_victim(running: list[Request]) -> Request:
        """The running request to preempt when the pool is full."""


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    @staticmethod
    def pick_victim(running: list[Request]) -> Request:
        return running[-1]  # the latest admitted


def _priority_key(request: Request) -> tuple[int, float, str]:
    return (request.priority, request.arrival_time, request.request_id)


class PriorityQueue(RequestQueue):
    """Lower ``priority`` first, then earlier arrival."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, str], Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (_priority_key(request), request))

    add_preempted = add  # its key already places it correctly

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [(k, r) for k, r in self._heap if r is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (r for _, r in sorted(self._heap, key=lambda kr: kr[0]))

    @staticmethod
    def pick_victim(running: list[Request]) -> Request:
        return max(running, key=_priority_key)


QUEUES: dict[str, type[RequestQueue]] = {"fcfs": FCFSQueue, "priority": PriorityQueue}
