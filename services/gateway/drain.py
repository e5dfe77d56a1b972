"""The gateway's graceful shutdown: drain first, then let uvicorn stop.

    SIGTERM / SIGINT ─► draining: /ready 503; new requests 503 + Retry-After (the listener stays open,
                        so clients and load balancers get an answer, not a refused connection)
                     ─► requests in flight finish, for at most drain_timeout_s
                     ─► any still running end: streams with an in-band error and [DONE], others with a 503;
                        their engines get an Abort (Frontend.release) before Redis is closed
                     ─► uvicorn's own shutdown (close connections, lifespan shutdown) ─► exit 0

uvicorn alone would close the listener at once, wait for open connections, then re-raise the signal
(the process would end by SIGTERM, not exit 0). A second signal skips what is left of the drain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType

import uvicorn

from pagedserve.services.gateway.frontend import Frontend
from pagedserve.services.gateway.router import Disconnected

log = logging.getLogger(__name__)
_CUT_GRACE_S = 5.0  # after the drain timeout: how long cut requests get to send their error and aborts
SHUTTING_DOWN = "the server is shutting down"


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, frontend: Frontend, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.frontend = frontend
        self.drain_timeout_s = drain_timeout_s
        self.is_drain_requested = False
        self._drain: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: only set a flag; the drain starts on the event loop at the next tick.
        if self.is_drain_requested or not self.started:
            super().handle_exit(sig, frame)  # a second signal, or one during start-up: stop now
            return
        self.is_drain_requested = True

    async def on_tick(self, counter: int) -> bool:
        if self.is_drain_requested and self._drain is None:
            self._drain = asyncio.create_task(self.drain())
        return await super().on_tick(counter)

    async def drain(self) -> None:
        frontend = self.frontend
        frontend.is_draining = True
        log.info("draining: %d requests in flight, at most %.1f s", frontend.num_in_flight, self.drain_timeout_s)
        await _wait_idle(frontend, self.drain_timeout_s)
        if frontend.num_in_flight:
            log.warning("drain timeout: ending %d requests with an error", frontend.num_in_flight)
            for queue in list(frontend.router.queues.values()):
                queue.put_nowait(Disconnected(SHUTTING_DOWN))
            await _wait_idle(frontend, _CUT_GRACE_S)
        log.info("drained; shutting down")
        self.should_exit = True


async def _wait_idle(frontend: Frontend, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while frontend.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
