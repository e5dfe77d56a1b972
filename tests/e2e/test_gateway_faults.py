"""Gateway faults (reliability scenarios 7, 8, 9) on a random-weight tiny model, which is fast on a CPU.

- Migration ends a request once: streams moved off a killed engine finish, the in-flight gauge returns
  to 0 and a new full batch (as many as --max-in-flight) is served without a 429.
- Queued streams are never silent: with one engine that runs one sequence at a time, no queued stream
  goes longer than the keep-alive interval without a byte, and real clients (openai, langchain-openai)
  read streams with keep-alive comments to the right text.
- A gateway worker killed with SIGKILL is replaced, and new connections are all served meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import redis

from pagedserve.shared import streams
from pagedserve.shared.protocol import Abort, EngineHeartbeat, decode_as
from pagedserve.shared.redis_server import PrivateRedis, free_port
from tests.conftest import start_service, stop_all
from tests.e2e.tiny_llama import build_tiny_llama

MODEL = "tiny-faults"
LOAD = 16  # streams per batch, and the gateway's --max-in-flight
KEEPALIVE_S = 1.0


@dataclass
class Stack:
    base_url: str
    redis_url: str
    env: dict[str, str]
    common: list[str]  # --model and --served-model-name
    log_dir: Path
    processes: dict[str, subprocess.Popen[bytes]]

    def start_engine(self, engine_id: str, *args: str) -> subprocess.Popen[bytes]:
        engine = start_service(
            engine_id,
            ["engine", *self.common, "--engine-id", engine_id, "--device", "cpu", "--cpu-threads", "1", *args],
            self.env,
            self.log_dir,
        )
        self.processes[engine_id] = engine
        deadline = time.monotonic() + 120
        while heartbeat(self, engine_id) is None:
            assert engine.poll() is None and time.monotonic() < deadline, f"engine {engine_id} did not start"
            time.sleep(0.2)
        return engine

    def wait_serving(self) -> None:
        """Until a request is served: /ready alone can answer from the gateway's view of a second ago, when the
        previous test's engine (now stopped) was still live, and the next request then finds none."""
        deadline = time.monotonic() + 60
        while True:
            try:
                reply = httpx.post(
                    f"{self.base_url}/v1/completions",
                    timeout=30,
                    json={"model": MODEL, "prompt": "ready?", "max_tokens": 1},
                )
                if reply.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway serves no request"
            time.sleep(0.2)


def heartbeat(stack: Stack, engine_id: str) -> EngineHeartbeat | None:
    r = redis.Redis.from_url(stack.redis_url)
    try:
        raw = r.get(streams.engine_key(MODEL, engine_id))
        return None if raw is None else decode_as(raw, EngineHeartbeat)
    finally:
        r.close()


@pytest.fixture(scope="module")
def stack(redis_server: PrivateRedis, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A tokenizer and a gateway for the tiny model; each test starts the engines it needs."""
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("models") / MODEL, smollm2_dir)
    log_dir = tmp_path_factory.mktemp("faults-logs")
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": redis_server.url, "PAGEDSERVE_LOG_LEVEL": "INFO"}
    common = ["--model", str(model_dir), "--served-model-name", MODEL]
    port = free_port()
    processes = {
        "faults-tokenizer": start_service("faults-tokenizer", ["tokenizer", *common], env, log_dir),
        "faults-gateway": start_service(
            "faults-gateway",
            [
                "gateway",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--max-in-flight",
                str(LOAD),
                "--sse-keepalive-s",
                str(KEEPALIVE_S),
            ],
            env,
            log_dir,
        ),
    }
    try:
        yield Stack(f"http://127.0.0.1:{port}", redis_server.url, env, common, log_dir, processes)
    finally:
        stop_all(processes)


async def stream_text(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, int]:
    text, tokens = "", 0
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        text += "".join(c.text for c in chunk.choices)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, tokens


def in_flight(base_url: str) -> float:
    metrics = httpx.get(f"{base_url}/metrics", timeout=5).text
    match = re.search(r"^pagedserve_requests_in_flight(?:\{[^}]*\})? (\S+)$", metrics, re.MULTILINE)
    assert match is not None, "no in-flight gauge on /metrics"
    return float(match.group(1))


def test_migrated_streams_free_their_slots(stack: Stack) -> None:
    steady = stack.start_engine("faults-steady")
    doomed = stack.start_engine("faults-doomed", "--heartbeat-ttl-s", "3")
    stack.wait_serving()
    max_tokens = 400  # long enough that the kill lands mid-stream

    async def killed_mid_stream() -> list[tuple[str, int]]:
        async def kill_when_busy() -> None:
            while (beat := heartbeat(stack, "faults-doomed")) is None or beat.num_running == 0:
                await asyncio.sleep(0.02)
            doomed.send_signal(signal.SIGKILL)

        async with openai.AsyncOpenAI(
            base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=120
        ) as client:
            killer = asyncio.create_task(kill_when_busy())
            answers = await asyncio.gather(*(stream_text(client, f"Story {i}:", max_tokens) for i in range(LOAD)))
            await asyncio.wait_for(killer, 5)
            return list(answers)

    try:
        answers = asyncio.run(killed_mid_stream())
        assert doomed.wait(timeout=10) == -signal.SIGKILL
        assert [tokens for _, tokens in answers] == [max_tokens] * LOAD  # every stream finished, moved or not
        assert "continues as" in (stack.log_dir / "faults-gateway.log").read_text()  # some did move
        deadline = time.monotonic() + 5
        while in_flight(stack.base_url) != 0:  # every slot freed, the moved requests' too
            assert time.monotonic() < deadline, f"in-flight gauge stuck at {in_flight(stack.base_url)}"
            time.sleep(0.1)

        async def full_batch() -> list[tuple[str, int]]:  # exactly --max-in-flight: any leaked slot means a 429
            async with openai.AsyncOpenAI(
                base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=60
            ) as client:
                return list(await asyncio.gather(*(stream_text(client, f"Again {i}:", 4) for i in range(LOAD))))

        assert [tokens for _, tokens in asyncio.run(full_batch())] == [4] * LOAD
    finally:
        stop_all({"faults-steady": steady, "faults-doomed": doomed})


async def raw_gaps(client: httpx.AsyncClient, base_url: str, prompt: str, max_tokens: int) -> tuple[float, bytes]:
    """The longest silence (s) of one stream after its headers, and every byte it sent."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        last, longest, raw = time.monotonic(), 0.0, b""
        async for data in response.aiter_raw():
            now = time.monotonic()
            longest, last, raw = max(longest, now - last), now, raw + data
    return max(longest, time.monotonic() - last), raw


def test_queued_streams_are_never_silent(stack: Stack) -> None:
    from langchain_openai import ChatOpenAI

    engine = stack.start_engine("faults-one-at-a-time", "--max-num-seqs", "1")  # everything else queues
    stack.wait_serving()
    max_tokens = 96
    question = [{"role": "user", "content": "Tell me about keep-alives."}]
    try:
        with openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
            expected = (
                client.chat.completions.create(model=MODEL, messages=question, max_tokens=max_tokens, temperature=0)
                .choices[0]
                .message.content
            )

        async def openai_stream() -> str:
            async with openai.AsyncOpenAI(
                base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=120
            ) as client:
                stream = await client.chat.completions.create(
                    model=MODEL, messages=question, stream=True, max_tokens=max_tokens, temperature=0
                )
                return "".join([c.delta.content or "" async for chunk in stream for c in chunk.choices])

        async def langchain_stream() -> str:
            chat = ChatOpenAI(  # type: ignore[call-arg]  # mypy misses the pydantic alias max_tokens
                base_url=f"{stack.base_url}/v1",
                api_key="x",
                model=MODEL,
                temperature=0,
                max_tokens=max_tokens,
                max_retries=0,
                timeout=120,
            )
            return "".join([str(chunk.content) async for chunk in chat.astream([("user", question[0]["content"])])])

        async def queue_up() -> tuple[list[tuple[float, bytes]], list[str]]:
            limits = httpx.Limits(max_connections=LOAD)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                raw = [
                    asyncio.create_task(raw_gaps(client, stack.base_url, f"Queue {i}:", max_tokens))
                    for i in range(LOAD - 2)
                ]
                await asyncio.sleep(0.5)  # the real clients' streams queue behind those
                texts = await asyncio.gather(openai_stream(), langchain_stream())
                return list(await asyncio.gather(*raw)), list(texts)

        started = time.monotonic()
        raw, texts = asyncio.run(queue_up())
        took = time.monotonic() - started
        longest = max(gap for gap, _ in raw)
        print(f"{LOAD} queued streams in {took:.1f} s; longest silence {longest:.2f} s (keep-alive {KEEPALIVE_S} s)")
        assert longest <= KEEPALIVE_S + 1.0
        assert sum(body.count(b": keep-alive\n\n") for _, body in raw) >= 1  # they were queued, and kept alive
        assert all(body.endswith(b"data: [DONE]\n\n") for _, body in raw)
        assert texts == [expected, expected]  # the comments are skipped by both clients
    finally:
        stop_all({"faults-one-at-a-time": engine})


def gateway_workers(supervisor: subprocess.Popen[bytes]) -> list[psutil.Process]:
    children = psutil.Process(supervisor.pid).children()
    return [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]


def listens_on(process: psutil.Process, port: int) -> bool:
    try:
        connections = process.net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in connections)


def test_a_killed_gateway_worker_is_replaced(
    redis_server: PrivateRedis, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The supervisor keeps the port served through a worker's death and still stops every worker, the
    replacement too, on SIGTERM (within its own bound: drain_timeout_s + 15 s, then SIGKILL and exit 1).
    On failure the gateway's log (supervisor and workers) is in the assertion message."""
    log_dir = tmp_path_factory.mktemp("workers-logs")
    log_path = log_dir / "workers-gateway.log"
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": redis_server.url, "PAGEDSERVE_LOG_LEVEL": "INFO"}
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    args = ["gateway", "--host", "127.0.0.1", "--port", str(port), "--workers", "2", "--gateway-drain-timeout-s", "5"]
    supervisor = start_service("workers-gateway", args, env, log_dir)
    try:
        deadline = time.monotonic() + 60
        while len(workers := gateway_workers(supervisor)) < 2 or not all(listens_on(w, port) for w in workers):
            assert supervisor.poll() is None and time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.1)
        victim = workers[0]
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()

        served = 0
        for _ in range(20):  # each on a new connection: the kernel spreads them over the live sockets
            with httpx.Client(timeout=5) as client:
                served += client.get(f"{base_url}/v1/models").status_code == 200
        assert served == 20 and time.monotonic() - killed_at < 10

        while not any(
            w.pid != victim.pid and w.pid not in {x.pid for x in workers} and listens_on(w, port)
            for w in gateway_workers(supervisor)
        ):
            assert time.monotonic() - killed_at < 30, "the killed worker was not replaced"
            time.sleep(0.05)
        print(f"killed worker replaced and listening after {time.monotonic() - killed_at:.2f} s")
        assert len(gateway_workers(supervisor)) == 2 and supervisor.poll() is None
        assert "replaced by pid" in log_path.read_text()

        supervisor.send_signal(signal.SIGTERM)  # still drains and stops every worker, the new one too
        stopped_at = time.monotonic()
        assert supervisor.wait(timeout=30) == 0
        print(f"supervisor exited {time.monotonic() - stopped_at:.2f} s after SIGTERM")
    except (AssertionError, subprocess.TimeoutExpired) as exc:
        raise AssertionError(f"{exc}\n----- gateway log (tail) -----\n{log_path.read_text()[-8000:]}") from exc
    finally:
        stop_all({"workers-gateway": supervisor})


def aborted_since(stack: Stack, since_ms: int) -> list[str]:
    """The request ids every Abort on the model's control stream names, from `since_ms` on."""
    r = redis.Redis.from_url(stack.redis_url)
    try:
        entries: Any = r.xrange(streams.control_stream(MODEL), min=f"{since_ms}-0")  # redis-py's types are loose
    finally:
        r.close()
    return [i for _, fields in entries for i in decode_as(fields[streams.DATA_FIELD], Abort).request_ids]


def test_a_request_queued_too_long_gets_429_and_is_aborted(stack: Stack) -> None:
    engine = stack.start_engine("faults-queue-wait", "--max-num-seqs", "1")
    stack.wait_serving()
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    gateway = start_service(
        "queue-wait-gateway",
        ["gateway", "--host", "127.0.0.1", "--port", str(port), "--max-queue-wait-s", "1"],
        stack.env,
        stack.log_dir,
    )
    queued = {"model": MODEL, "prompt": "Queued:", "max_tokens": 200}
    try:
        Stack(base_url, stack.redis_url, stack.env, stack.common, stack.log_dir, {}).wait_serving()

        async def blocker(client: httpx.AsyncClient, started: asyncio.Event) -> None:
            body = {"model": MODEL, "prompt": "Long:", "max_tokens": 1900, "stream": True, "ignore_eos": True}
            async with client.stream("POST", f"{stack.base_url}/v1/completions", json=body) as response:
                async for _ in response.aiter_raw():
                    started.set()

        async def behind_long_requests() -> tuple[httpx.Response, bytes]:
            async with httpx.AsyncClient(timeout=60) as client:
                # Seconds of work for the one-sequence engine, through the gateway without the short limit.
                started = asyncio.Event()
                blockers = [asyncio.create_task(blocker(client, started)) for _ in range(6)]
                await started.wait()
                plain, streamed = await asyncio.gather(
                    client.post(f"{base_url}/v1/completions", json=queued),
                    client.post(f"{base_url}/v1/completions", json={**queued, "stream": True}),
                )
                for task in blockers:
                    task.cancel()
                await asyncio.gather(*blockers, return_exceptions=True)
                return plain, streamed.content

        since_ms = int(time.time() * 1000)
        plain, streamed = asyncio.run(behind_long_requests())
        assert plain.status_code == 429 and int(plain.headers["retry-after"]) >= 1, plain.text
        assert plain.json()["error"]["code"] == "queue_wait_exceeded"
        assert b"queue_wait_exceeded" in streamed and streamed.endswith(b"data: [DONE]\n\n")  # in-band
        log = (stack.log_dir / "queue-wait-gateway.log").read_text()
        given_up = re.findall(r"(cmpl-\w+) had no first token", log)
        assert len(given_up) == 2 and set(given_up) <= set(aborted_since(stack, since_ms))  # aborted at the engine
    finally:
        stop_all({"queue-wait-gateway": gateway, "faults-queue-wait": engine})
