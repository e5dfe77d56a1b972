"""The gateway's graceful shutdown (DrainingServer): a first signal drains, in-flight requests finish or are
cut with an error after the timeout, and uvicorn then stops without re-raising the signal."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pagedserve.services.gateway import drain
from pagedserve.services.gateway.drain import SHUTTING_DOWN, DrainingServer
from pagedserve.services.gateway.frontend import Frontend
from pagedserve.services.gateway.router import Disconnected
from pagedserve.shared.redis_server import free_port
from tests.gateway.gateway_helpers import offline_frontend


async def hello(request: object) -> PlainTextResponse:
    return PlainTextResponse("hi")


def make_server(drain_timeout_s: float) -> tuple[DrainingServer, Frontend]:
    frontend, _ = offline_frontend()
    app = Starlette(routes=[Route("/", hello)])
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), lifespan="off", log_level="warning")
    return DrainingServer(config, frontend, drain_timeout_s), frontend


def test_a_signal_before_start_up_or_a_second_one_stops_at_once() -> None:
    server, frontend = make_server(30)
    server.handle_exit(signal.SIGTERM, None)  # still starting: nothing to drain
    assert server.should_exit and not server.is_drain_requested

    server, frontend = make_server(30)
    server.started = True
    server.handle_exit(signal.SIGTERM, None)
    assert server.is_drain_requested and not server.should_exit  # the drain starts at the next tick
    assert not frontend.is_draining  # a signal handler only sets a flag
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit  # the second signal skips what is left of the drain


def test_the_drain_waits_for_requests_in_flight_then_exits() -> None:
    server, frontend = make_server(30)
    server.started = True
    frontend.num_in_flight = 2

    async def scenario() -> float:
        server.handle_exit(signal.SIGTERM, None)
        assert not await server.on_tick(1)  # the tick starts the drain and does not stop the server yet
        await asyncio.sleep(0.2)
        assert frontend.is_draining and not server.should_exit  # requests still running: keep serving them
        frontend.num_in_flight = 0  # they finish
        started = time.monotonic()
        while not await server.on_tick(2):
            await asyncio.sleep(0.01)
        assert server._drain is not None and server._drain.done()
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 1.0  # long before the 30 s timeout
    assert frontend.router.queues == {}


def test_requests_still_running_at_the_timeout_end_with_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drain, "_CUT_GRACE_S", 2.0)
    server, frontend = make_server(0.2)
    queues = [frontend.router.register(f"r{i}") for i in range(2)]
    frontend.num_in_flight = 2
    got: list[object] = []

    async def request(queue: asyncio.Queue[object]) -> None:  # a stream waiting for tokens that never come
        got.append(await queue.get())
        frontend.num_in_flight -= 1  # it sends its error and ends

    async def scenario() -> float:
        tasks = [asyncio.create_task(request(q)) for q in queues]
        started = time.monotonic()
        await server.drain()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return time.monotonic() - started

    took = asyncio.run(scenario())
    assert 0.2 <= took < 1.5  # the drain timeout, then only as long as the cut requests take
    assert [type(g) for g in got] == [Disconnected, Disconnected]
    assert all(isinstance(g, Disconnected) and g.message == SHUTTING_DOWN and g.final for g in got)
    assert server.should_exit and frontend.num_in_flight == 0


def test_serving_then_draining_ends_serve_normally() -> None:
    """The real uvicorn loop: the drained server returns from serve() (no signal re-raised: exit 0)."""
    server, frontend = make_server(30)
    frontend.num_in_flight = 1

    async def scenario() -> None:
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        server.handle_exit(signal.SIGTERM, None)
        await asyncio.sleep(0.3)
        assert frontend.is_draining and not serving.done()  # a request in flight holds the exit
        frontend.num_in_flight = 0
        await asyncio.wait_for(serving, 5)

    asyncio.run(scenario())
    assert server.should_exit and not server.force_exit
