"""Offered load: Poisson arrivals at a request rate (or all at once), capped at a concurrency,
driven by one event loop, or by several client processes for servers faster than one Python
process can read (~15k SSE events/s).
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import random
import time
from dataclasses import dataclass
from typing import Any

from bench.serve.client import ClientConfig, RequestResult, new_session, send
from bench.serve.datasets import BenchRequest


@dataclass(slots=True)
class LoadSpec:
    request_rate: float = math.inf  # requests/s of a Poisson process; inf: all at once
    max_concurrency: int | None = None  # requests in flight at most; None: no cap
    seed: int = 0
    client_processes: int = 1


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: exponential gaps of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


_START_TIMEOUT_S = 300.0
_start_together: Any = None  # a client process's barrier: every process has imported and connected


def _join(barrier: Any) -> None:
    global _start_together
    _start_together = barrier


async def _run(
    config: ClientConfig,
    requests: list[BenchRequest],
    offsets: list[float],
    max_concurrency: int | None,
) -> list[RequestResult]:
    limit = max_concurrency or len(requests)
    gate = asyncio.Semaphore(limit)
    async with new_session(config, max(1, limit)) as session:
        if _start_together is not None:  # processes start together, however long their imports took
            await asyncio.to_thread(_start_together.wait, _START_TIMEOUT_S)  # a process that died: an error, not a hang
        start = time.perf_counter()

        async def one(request: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with gate:
                return await send(session, config, request)

        return list(await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets))))


def _run_in_process(args: tuple[ClientConfig, list[BenchRequest], list[float], int | None]) -> list[dict]:
    return [r.to_dict() for r in asyncio.run(_run(*args))]


def run_load(config: ClientConfig, requests: list[BenchRequest], spec: LoadSpec) -> list[RequestResult]:
    """Send every request as `spec` says; results in the order of `requests`."""
    offsets = arrival_offsets(len(requests), spec.request_rate, spec.seed)
    procs = max(1, min(spec.client_processes, len(requests)))
    if procs == 1:
        return asyncio.run(_run(config, requests, offsets, spec.max_concurrency))
    # Request i goes to process i % procs, keeping its arrival time; the concurrency cap is split.
    cap = spec.max_concurrency
    caps = [None if cap is None else max(1, cap // procs + (p < cap % procs)) for p in range(procs)]
    jobs = [(config, requests[p::procs], offsets[p::procs], caps[p]) for p in range(procs)]
    # A spawned process imports the benchmark again (torch among it): seconds on a cold machine, more than
    # any fixed head start. A barrier starts them together once the last one is ready.
    context = multiprocessing.get_context("spawn")
    with context.Pool(procs, initializer=_join, initargs=(context.Barrier(procs),)) as pool:
        parts = pool.map(_run_in_process, jobs, chunksize=1)
    results: list[RequestResult] = [RequestResult(0.0, 0, 0)] * len(requests)
    for p, part in enumerate(parts):
        for i, row in zip(range(p, len(requests), procs), part):
            results[i] = RequestResult(**row)
    return results
