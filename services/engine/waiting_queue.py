"""The scheduler's waiting queue, in the order the scheduling policy admits requests.

    fcfs      arrival order; a preempted sequence goes back to the front
    priority  lowest `priority` value first (vLLM's meaning), then arrival order; a preempted
              sequence keeps its place by its original arrival

Both give the scheduler the same five operations; the policy's whole effect on admission is here.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from pagedserve.services.engine.request import Request

POLICIES = ("fcfs", "priority")


def priority_key(request: Request) -> tuple[int, int]:
    """Sort key of the priority policy: the smaller, the sooner (and the later it is preempted)."""
    return request.params.priority, request.arrival_seq


class FCFSQueue:
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
        """Raises ValueError when `request` is not queued."""
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(request), request))

    add_preempted = add  # its original arrival puts it ahead of later arrivals of its level

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        """Raises ValueError when `request` is not queued (aborts are rare: a linear scan is fine)."""
        index = next((i for i, item in enumerate(self._heap) if item[2] is request), None)
        if index is None:
            raise ValueError("request is not waiting")
        self._heap[index] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (item[2] for item in sorted(self._heap, key=lambda item: item[:2]))


def waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy not in POLICIES:
        raise ValueError(f"scheduling_policy: {policy!r} is not one of {', '.join(POLICIES)}")
    return PriorityQueue() if policy == "priority" else FCFSQueue()
