"""Reliability scenario 5 for the gateway: SIGTERM with a stream in flight.

A second gateway process joins the session's Redis, tokenizer and engine, so the shared gateway is never
stopped. After SIGTERM it answers /ready and new requests with 503 (Retry-After) while the stream in flight
goes on; a stream that outlives the drain timeout ends with an in-band error and its engine drops the
sequence. Either way the process exits 0 and nothing stays pending in Redis.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import redis

from pagedserve.shared import streams
from pagedserve.shared.protocol import EngineHeartbeat, decode_as
from pagedserve.shared.redis_server import free_port
from tests.conftest import RunningServices, start_service, stop_all, wait_ready
from tests.e2e.checks import answer_normally, wait_nothing_pending


def start_gateway(services: RunningServices, name: str, drain_timeout_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": services.redis_url, "PAGEDSERVE_LOG_LEVEL": "INFO"}
    gateway = start_service(
        name,
        ["gateway", "--host", "127.0.0.1", "--port", str(port), "--gateway-drain-timeout-s", str(drain_timeout_s)],
        env,
        services.log_dir,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, {name: gateway})
    except BaseException:
        stop_all({name: gateway})
        raise
    return gateway, base_url


def events(lines: Iterator[str]) -> Iterator[Any]:
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def first_token_then_sigterm(gateway: subprocess.Popen, stream: Iterator[Any]) -> list[Any]:
    seen = []
    for event in stream:
        seen.append(event)
        if event != "[DONE]" and event.get("choices") and event["choices"][0].get("text"):
            gateway.send_signal(signal.SIGTERM)
            return seen
    raise AssertionError(f"the stream ended before its first token: {seen}")


def assert_refusing(base_url: str, model: str) -> None:
    """Within a moment of SIGTERM: /ready fails and a new request gets 503 with Retry-After."""
    deadline = time.monotonic() + 5
    while (ready := httpx.get(f"{base_url}/ready", timeout=5)).status_code != 503:
        assert time.monotonic() < deadline, "still ready after SIGTERM"
        time.sleep(0.05)
    assert ready.json()["ready"] is False
    refused = httpx.post(
        f"{base_url}/v1/completions", timeout=10, json={"model": model, "prompt": "Hello", "max_tokens": 4}
    )
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert "shutting down" in refused.json()["error"]["message"]


def num_running(services: RunningServices) -> int:
    r = redis.Redis.from_url(services.redis_url)
    try:
        beats = [r.get(k) for k in r.scan_iter(match=streams.engine_key(services.model, "*"))]
        return sum(decode_as(b, EngineHeartbeat).num_running for b in beats if b is not None)
    finally:
        r.close()


def test_a_stream_in_flight_finishes_after_sigterm_and_the_gateway_exits_0(services: RunningServices) -> None:
    gateway, base_url = start_gateway(services, "gateway-sigterm-drain", drain_timeout_s=60)
    try:
        body = {
            "model": services.model,
            "prompt": "Once upon a time",
            "max_tokens": 64,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            stream = events(response.iter_lines())
            seen = first_token_then_sigterm(gateway, stream)
            assert_refusing(base_url, services.model)
            seen += list(stream)
        assert seen[-1] == "[DONE]" and not any("error" in e for e in seen[:-1])
        finishes = [c["finish_reason"] for e in seen[:-1] for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"] and seen[-2]["usage"]["completion_tokens"] == 64
        assert gateway.wait(timeout=30) == 0
    finally:
        stop_all({"gateway-sigterm-drain": gateway})
    wait_nothing_pending(services.redis_url, services.model)
    answer_normally(services.base_url, services.model)


def test_a_stream_beyond_the_drain_timeout_ends_in_band_and_its_engine_stops(services: RunningServices) -> None:
    gateway, base_url = start_gateway(services, "gateway-sigterm-cut", drain_timeout_s=1)
    try:
        body = {
            "model": services.model,
            "prompt": "Once upon a time",
            "max_tokens": 1500,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            stream = events(response.iter_lines())
            first_token_then_sigterm(gateway, stream)
            signalled = time.monotonic()
            assert_refusing(base_url, services.model)
            rest = list(stream)
        assert time.monotonic() - signalled < 10  # the 1 s drain, not the 1,500 tokens
        assert rest[-1] == "[DONE]" and "shutting down" in rest[-2]["error"]["message"]
        assert gateway.wait(timeout=30) == 0
        deadline = time.monotonic() + 10  # the engine got the abort: the sequence is gone, not left to run
        while num_running(services):
            assert time.monotonic() < deadline, "the engine still runs the cut request"
            time.sleep(0.2)
    finally:
        stop_all({"gateway-sigterm-cut": gateway})
    wait_nothing_pending(services.redis_url, services.model)
    answer_normally(services.base_url, services.model)
