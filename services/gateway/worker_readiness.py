"""Readiness across gateway workers: one byte per worker in memory the supervisor shares with them.

With --workers N every worker listens on the port (SO_REUSEPORT), so a probe of /ready reaches one of them
while the kernel spreads the traffic over all. A worker that is still loading a tokenizer (seconds, holding
its event loop's GIL) must keep the whole gateway unready, or a load balancer, `serve`'s ready line and a
benchmark start sending requests that stall behind it. Each worker publishes its own readiness here; /ready
on any worker is true only while every worker's is.
"""

from __future__ import annotations

from typing import Any


class WorkerReadiness:
    def __init__(self, flags: Any, index: int) -> None:  # flags: a multiprocessing RawArray("b", workers)
        self.flags = flags
        self.index = index

    def publish(self, is_ready: bool) -> None:
        self.flags[self.index] = int(is_ready)

    def all_ready(self) -> bool:
        return all(self.flags[:])
