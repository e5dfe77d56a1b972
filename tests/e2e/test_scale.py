"""Scale on one machine: 1,024 concurrent streams through a 2-worker gateway over two engine replicas
of one model. Every stream completes with 200 and its greedy answer, both gateway workers and both
engines take work, and nothing stays pending in Redis.

Then cache-aware routing over the same two replicas: prompts sharing a long prefix all go to the replica
that holds it (each finds it in the cache), one sent to a replica that hangs is taken over by the
other and answered as it would have been, and a multi-turn workload hits the cache as often as on one
engine with prefix routing, less often with pull routing."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from bench.serve.client import ClientConfig
from bench.serve_multiturn import Workload, conversations, run, summarize
from pagedserve.shared import streams
from pagedserve.shared.protocol import EngineHeartbeat, GenerateRequest, TokenDeltas, decode, decode_as, encode
from pagedserve.shared.redis_server import free_port
from tests.conftest import RunningServices, start_service, stop_all
from tests.e2e.checks import num_pending
from tests.e2e.tiny_llama import build_tiny_llama

MODEL = "tiny-scale"
NUM_STREAMS = 1024
ENGINE_IDS = ("scale-engine-a", "scale-engine-b")
GATEWAY_ID = "gw-scale"
PROMPTS = ["The quick brown fox", "Once upon a time", "Redis streams are", "In the beginning"]


@dataclass
class ScaledServices:
    base_url: str
    redis_url: str
    processes: dict[str, subprocess.Popen[bytes]]
    tokenizer_command: list[str]  # to restart the tokenizer with other routing
    env: dict[str, str]
    log_dir: Path


@pytest.fixture(scope="module")
def scaled(
    services: RunningServices, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ScaledServices]:
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("models") / MODEL, smollm2_dir)
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": services.redis_url}
    common = ["--model", str(model_dir), "--served-model-name", MODEL]
    port = free_port()
    tokenizer_command = ["tokenizer", *common]
    processes = {
        "scale-tokenizer": start_service("scale-tokenizer", tokenizer_command, env, services.log_dir),
        **{
            engine_id: start_service(
                engine_id,
                ["engine", *common, "--engine-id", engine_id, "--device", "cpu", "--cpu-threads", "1"],
                env,
                services.log_dir,
            )
            for engine_id in ENGINE_IDS
        },
        "scale-gateway": start_service(
            "scale-gateway",
            [
                "gateway",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "2",
                "--gateway-id",
                GATEWAY_ID,
                "--max-in-flight",
                str(2 * NUM_STREAMS),
            ],
            env,
            services.log_dir,
        ),
    }
    scaled = ScaledServices(
        f"http://127.0.0.1:{port}", services.redis_url, processes, tokenizer_command, env, services.log_dir
    )
    try:
        deadline = time.monotonic() + 180
        # Each worker refreshes its own registry: ask until many fresh connections in a row (spread over
        # the workers by SO_REUSEPORT) all list the model.
        in_a_row = 0
        while len(_heartbeats(scaled)) < len(ENGINE_IDS) or in_a_row < 16:
            assert all(p.poll() is None for p in processes.values()), "a scale-test service died at start-up"
            assert time.monotonic() < deadline, "scale-test services not ready"
            in_a_row = in_a_row + 1 if _serves_model(scaled.base_url) else 0
            time.sleep(0.1)
        yield scaled
    finally:
        stop_all(processes)


def _serves_model(base_url: str) -> bool:
    try:
        return MODEL in [m["id"] for m in httpx.get(f"{base_url}/v1/models", timeout=2).json()["data"]]
    except httpx.HTTPError:
        return False


def _heartbeats(scaled: ScaledServices) -> dict[str, EngineHeartbeat]:
    r = redis.Redis.from_url(scaled.redis_url)
    try:
        raw = {engine_id: r.get(streams.engine_key(MODEL, engine_id)) for engine_id in ENGINE_IDS}
        return {engine_id: decode_as(value, EngineHeartbeat) for engine_id, value in raw.items() if value}
    finally:
        r.close()


async def _stream(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, int, str | None]:
    text, finish, usage = "", None, 0
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return text, usage, finish


def test_1024_concurrent_streams_over_two_workers_and_two_engines(scaled: ScaledServices) -> None:
    async def run() -> tuple[dict[str, str], list[tuple[str, int, str | None]]]:
        limits = httpx.Limits(max_connections=NUM_STREAMS, max_keepalive_connections=NUM_STREAMS)
        async with (
            httpx.AsyncClient(limits=limits, timeout=300) as http,
            openai.AsyncOpenAI(
                base_url=f"{scaled.base_url}/v1", api_key="x", max_retries=0, http_client=http
            ) as client,
        ):
            expected = {p: (await _stream(client, p))[0] for p in PROMPTS}  # one at a time: the reference
            results = await asyncio.gather(*(_stream(client, PROMPTS[i % len(PROMPTS)]) for i in range(NUM_STREAMS)))
            return expected, results

    finished_before = sum(b.num_requests_finished for b in _heartbeats(scaled).values())
    expected, results = asyncio.run(run())  # any non-200 raises inside the openai client
    assert len(results) == NUM_STREAMS
    for i, (text, num_tokens, finish) in enumerate(results):
        assert (num_tokens, finish) == (4, "length"), f"stream {i}"
        assert text == expected[PROMPTS[i % len(PROMPTS)]], f"stream {i} got another answer under load"

    r = redis.Redis.from_url(scaled.redis_url)
    try:
        # Both workers answered streams: each has its own response stream.
        assert all(r.exists(streams.response_stream(f"{GATEWAY_ID}-{i}")) for i in range(2))
        deadline = time.monotonic() + 15
        while True:
            beats = _heartbeats(scaled)
            pending = sum(num_pending(r, MODEL).values())
            done = sum(b.num_requests_finished for b in beats.values()) - finished_before
            if pending == 0 and done >= NUM_STREAMS + len(PROMPTS):
                break
            assert time.monotonic() < deadline, f"{pending} entries pending, {done} requests counted"
            time.sleep(0.5)
    finally:
        r.close()
    # Pull-based admission spreads the work: both replicas took a share of it.
    finished = {engine_id: beat.num_requests_finished for engine_id, beat in beats.items()}
    assert all(count > 0 for count in finished.values()), finished


def _owner_after(scaled: ScaledServices, before: dict[str, int]) -> str:
    """The replica whose finished count rose since `before` (heartbeats are refreshed every second)."""
    deadline = time.monotonic() + 10
    while True:
        rose = [e for e, b in _heartbeats(scaled).items() if b.num_requests_finished > before.get(e, 0)]
        if len(rose) == 1:
            return rose[0]
        assert time.monotonic() < deadline, f"no single replica ran the request: {rose}"
        time.sleep(0.2)


def _wait_finished(scaled: ScaledServices, engine_id: str, count: int) -> dict[str, int]:
    """Finished counts once `engine_id`'s reaches `count` (heartbeats catch up within a second)."""
    deadline = time.monotonic() + 10
    while (finished := _finished(scaled))[engine_id] < count:
        assert time.monotonic() < deadline, (engine_id, count, finished)
        time.sleep(0.2)
    return finished


def _finished(scaled: ScaledServices) -> dict[str, int]:
    return {e: b.num_requests_finished for e, b in _heartbeats(scaled).items()}


def _complete(scaled: ScaledServices, prompt: list[int]) -> openai.types.Completion:
    with openai.OpenAI(base_url=f"{scaled.base_url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        return client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
        )


def test_a_shared_prefix_goes_to_the_replica_that_holds_it(scaled: ScaledServices) -> None:
    prefix = [1000 + i for i in range(96)]  # six 16-token KV blocks
    time.sleep(1.5)  # the tokenizer sees both replicas (its view is refreshed every second)
    before = _finished(scaled)
    first = _complete(scaled, [*prefix, 7]).usage
    assert first is not None and first.prompt_tokens_details is not None
    assert first.prompt_tokens_details.cached_tokens == 0
    owner = _owner_after(scaled, before)
    cached = []
    for i in range(8):  # pulled by whichever replica is free, most would miss the cache on the other one
        usage = _complete(scaled, [*prefix, 50 + i, 7]).usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached.append(usage.prompt_tokens_details.cached_tokens)
    assert cached == [len(prefix)] * 8  # any on the other replica would have missed
    finished = _wait_finished(scaled, owner, before[owner] + 9)
    assert sum(finished.values()) - sum(before.values()) == 9, (owner, before, finished)


def test_work_sent_to_a_hung_replica_is_taken_over(scaled: ScaledServices) -> None:
    prompt = [3000 + i for i in range(96)] + [7]
    time.sleep(1.5)
    before = _finished(scaled)
    reference = _complete(scaled, prompt).choices[0].text
    owner = _owner_after(scaled, before)
    other = next(e for e in ENGINE_IDS if e != owner)
    r = redis.Redis.from_url(scaled.redis_url)
    scaled.processes[owner].send_signal(signal.SIGSTOP)  # hung: its heartbeat lives on for its TTL
    try:
        replies: list[openai.types.Completion | BaseException] = []

        def send() -> None:
            try:
                replies.append(_complete(scaled, prompt))
            except BaseException as exc:  # shown by the assertion below
                replies.append(exc)

        sending = threading.Thread(target=send)
        sending.start()
        deadline = time.monotonic() + 10
        while not r.xlen(streams.engine_stream(MODEL, owner)):  # the router sent it to the owner's stream
            assert sending.is_alive() and time.monotonic() < deadline, "the request was not routed to its owner"
            time.sleep(0.05)
        sending.join(timeout=90)
        assert replies and isinstance(replies[0], openai.types.Completion), (replies, time.monotonic() - deadline)
        assert replies[0].choices[0].text == reference  # the other replica took it over
        _wait_finished(scaled, other, before[other] + 1)
    finally:
        scaled.processes[owner].send_signal(signal.SIGCONT)
        r.close()
    deadline = time.monotonic() + 15
    while len(_heartbeats(scaled)) < len(ENGINE_IDS):  # the hung replica is back
        assert time.monotonic() < deadline, "the stopped replica did not come back"
        time.sleep(0.2)


def test_work_never_read_from_a_gone_replicas_stream_is_run_once_and_the_stream_removed(
    scaled: ScaledServices,
) -> None:
    """The other half of a takeover: entries no replica had read yet (here a replica that never came up)."""
    stream = streams.engine_stream(MODEL, "scale-engine-gone")
    reply_to = "gw-orphans"
    r = redis.Redis.from_url(scaled.redis_url)
    try:
        sampling = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
        for i in range(2):
            request = GenerateRequest(f"orphan-{i}", reply_to, MODEL, [5, 6, 7, 8 + i], dict(sampling))
            r.xadd(stream, {streams.DATA_FIELD: encode(request)})
        tokens: dict[str, list[int]] = {"orphan-0": [], "orphan-1": []}
        finished: set[str] = set()
        last_id, deadline = "0", time.monotonic() + 30
        while finished != set(tokens):
            assert time.monotonic() < deadline, f"not taken over: {tokens}"
            reply: Any = r.xread({streams.response_stream(reply_to): last_id}, block=500)
            for _, items in reply or []:
                for entry_id, fields in items:
                    last_id = entry_id
                    deltas = decode(fields[streams.DATA_FIELD])
                    assert isinstance(deltas, TokenDeltas)
                    for request_id, ids, finish in zip(deltas.request_ids, deltas.token_ids, deltas.finish_reasons):
                        tokens[request_id] += ids
                        if finish is not None:
                            finished.add(request_id)
        assert all(len(ids) == 3 for ids in tokens.values()), tokens  # each ran once, to its end
        deadline = time.monotonic() + 10
        while r.exists(stream):  # emptied, then removed by the replica that took it
            assert time.monotonic() < deadline, "the gone replica's stream was left behind"
            time.sleep(0.2)
    finally:
        r.delete(stream, streams.response_stream(reply_to))
        r.close()


# Each user's own context dominates its prompts (a conversation's history, not a shared system prompt, is
# what routing must keep): 6 users x 3 turns; with 16-token blocks a later turn finds 128-144 tokens cached
# on the replica that served the turn before, 0-32 on the other.
ROUTING_WORKLOAD = Workload(system_prompts=1, system_len=32, context_len=96, users=6, turns=3, user_len=8, output_len=4)


def _multi_turn_hit_rate(base_url: str, model: str, seed: int) -> float:
    workload = dataclasses.replace(ROUTING_WORKLOAD, seed=seed)  # fresh tokens: no run reuses another's cache
    convs = conversations(list(range(1000, 3000)), workload)
    config = ClientConfig(base_url, model, extra_body={"return_token_ids": True})
    asyncio.run(run(config, convs, workload, max_concurrency=workload.users))
    summary = summarize(convs, 1.0)
    assert summary["failed"] == 0 and summary["completed"] == workload.users * workload.turns, summary["errors"]
    return float(summary["prefix_hit_rate"])


def _restart_tokenizer(scaled: ScaledServices, extra_args: list[str]) -> None:
    old = scaled.processes["scale-tokenizer"]
    old.terminate()
    old.wait(timeout=30)
    scaled.processes["scale-tokenizer"] = start_service(
        "scale-tokenizer", [*scaled.tokenizer_command, *extra_args], scaled.env, scaled.log_dir
    )
    deadline = time.monotonic() + 60
    while True:  # served again once the new tokenizer is live; then it sees both replicas within a second
        try:
            _complete(scaled, [11, 12, 13])
            break
        except openai.APIError:
            assert time.monotonic() < deadline, "the restarted tokenizer did not serve"
            time.sleep(0.5)
    time.sleep(1.5)


def test_a_multi_turn_workload_hits_the_cache_as_on_one_engine_with_prefix_routing_and_less_with_pull(
    scaled: ScaledServices, services: RunningServices
) -> None:
    """Issue 22: the same workload through one engine (the session stack, same block size), the two replicas
    with prefix routing, and the two with pull routing (the tokenizer restarted with --routing pull)."""
    one = _multi_turn_hit_rate(services.base_url, services.model, seed=101)
    time.sleep(1.5)
    prefix = _multi_turn_hit_rate(scaled.base_url, MODEL, seed=102)
    _restart_tokenizer(scaled, ["--routing", "pull"])
    try:
        pull = _multi_turn_hit_rate(scaled.base_url, MODEL, seed=103)
    finally:
        _restart_tokenizer(scaled, [])
    rates = {"one engine": one, "prefix": prefix, "pull": pull}
    print(f"multi-turn hit rates: {rates}")
    assert one > 0.5, rates  # each later turn found its history
    assert prefix >= 0.9 * one, rates
    assert pull < prefix - 0.05, rates  # half of pull's later turns land where their history is not
