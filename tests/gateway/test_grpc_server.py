"""The gRPC front door's servicer over a Frontend whose submit is scripted (no Redis, no services):
auth from metadata, request translation, one response per choice update with the usage on the last,
API errors as status codes, Abort by the client's id, ListModels; and the real grpc.aio server with
its health service on a local port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.services.gateway.errors import APIError, model_not_found
from pagedserve.services.gateway.frontend import Frontend, Generation
from pagedserve.services.gateway.grpc_api import pagedserve_pb2 as pb
from pagedserve.services.gateway.grpc_api import pagedserve_pb2_grpc as pb_grpc
from pagedserve.services.gateway.grpc_api.server import SERVICE_NAME, GenerationService, start
from pagedserve.services.gateway.registry import ModelEntry
from pagedserve.shared.protocol import CompletionRequest, EngineHeartbeat, TokenizerHeartbeat
from pagedserve.shared.redis_server import free_port
from pagedserve.shared.tokenizer_loader import load_tokenizer
from tests.gateway.gateway_helpers import AbortRecorder, ScriptedSubmit, offline_frontend, open_generation

KEY = "grpc-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Aborted(Exception):
    """What grpc.aio's `context.abort` does: raise, ending the handler."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details


class Context:
    def __init__(self, metadata: tuple[tuple[str, str], ...] = AUTH) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def answer(prompt: str, index: int) -> str:
    return f" choice {index}"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return load_tokenizer(smollm2_dir)


@pytest.fixture()
def setup(tokenizer: Any) -> tuple[GenerationService, Frontend, ScriptedSubmit, AbortRecorder]:
    frontend, recorder = offline_frontend(api_keys=[KEY], grpc_port=free_port())
    refuse = {
        "unknown": model_not_found("m"),
        "busy": APIError(429, "too many requests in flight; retry shortly", retry_after=1),
    }
    script = ScriptedSubmit(frontend, tokenizer, answer, refuse=refuse)
    frontend.submit = script  # type: ignore[method-assign]
    return GenerationService(frontend, frontend.settings), frontend, script, recorder


def prompt_request(prompt: str, request_id: str = "", **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        model="m", request_id=request_id, prompt=prompt, sampling=pb.SamplingParams(max_tokens=8, **sampling)
    )


async def generate(service: GenerationService, request: pb.GenerateRequest, context: Context) -> list[Any]:
    return [response async for response in service.Generate(request, context)]


def test_generate_streams_choice_updates_with_the_usage_on_the_last_only(setup: Any, tokenizer: Any) -> None:
    service, frontend, script, recorder = setup
    request = prompt_request("The sky is", "client-1", n=2, stop=["\n\n"], temperature=0.5)
    context = Context((*AUTH, ("traceparent", TRACEPARENT)))
    responses = asyncio.run(generate(service, request, context))

    (wire,) = script.requests
    assert isinstance(wire, CompletionRequest) and wire.stream  # always streamed on the inside
    assert (wire.prompt, wire.max_tokens, wire.sampling.get("temperature"), wire.sampling.get("n")) == (
        "The sky is",
        8,
        0.5,
        2,
    )
    assert wire.request_id.startswith("grpc-") and wire.traceparent is not None
    assert wire.traceparent.split("-")[1] == TRACEPARENT.split("-")[1]  # the caller's trace goes on

    assert {r.request_id for r in responses} == {"client-1"}  # the id the client chose
    assert sorted((r.index, r.text, r.finish_reason) for r in responses) == [
        (0, " choice 0", "length"),
        (1, " choice 1", "length"),
    ]
    for r in responses:
        assert list(r.token_ids) == tokenizer.encode(answer("", r.index), add_special_tokens=False)
    with_usage = [r for r in responses if r.HasField("usage")]
    assert with_usage == [responses[-1]]  # "on the last response of the call"
    usage = responses[-1].usage
    assert usage.prompt_tokens == len(tokenizer.encode("The sky is"))
    assert usage.completion_tokens == sum(len(r.token_ids) for r in responses)
    assert service.running == {} and frontend.num_in_flight == 0 and recorder.aborts == []


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", KEY),)])
def test_a_missing_or_wrong_key_is_unauthenticated(setup: Any, metadata: tuple[tuple[str, str], ...]) -> None:
    service, _, script, _ = setup

    async def every_call() -> list[grpc.StatusCode]:
        codes = []
        for call in (
            generate(service, prompt_request("x"), Context(metadata)),
            service.Abort(pb.AbortRequest(request_id="x"), Context(metadata)),
            service.ListModels(pb.ListModelsRequest(), Context(metadata)),
        ):
            with pytest.raises(Aborted) as aborted:
                await call
            codes.append(aborted.value.code)
        return codes

    assert asyncio.run(every_call()) == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert script.requests == []  # refused before anything was submitted


@pytest.mark.parametrize(
    ("request_", "code", "in_details"),
    [
        (pb.GenerateRequest(model="m"), grpc.StatusCode.INVALID_ARGUMENT, "(param: input)"),
        (prompt_request("x", temperature=9), grpc.StatusCode.INVALID_ARGUMENT, "(param: temperature)"),
        (prompt_request("unknown"), grpc.StatusCode.NOT_FOUND, "(param: model)"),
        (prompt_request("busy"), grpc.StatusCode.RESOURCE_EXHAUSTED, "retry"),
    ],
)
def test_api_errors_become_status_codes(
    setup: Any, request_: pb.GenerateRequest, code: grpc.StatusCode, in_details: str
) -> None:
    service, frontend, _, _ = setup
    with pytest.raises(Aborted) as aborted:
        asyncio.run(generate(service, request_, Context()))
    assert aborted.value.code == code and in_details in aborted.value.details
    assert service.running == {} and frontend.num_in_flight == 0


def test_abort_ends_a_running_call_by_the_clients_id(setup: Any, tokenizer: Any) -> None:
    service, frontend, _, recorder = setup
    running: list[Generation] = []

    async def submit(req: CompletionRequest, stop: list[str], n: int, text: Any = None) -> Generation:
        gen = open_generation(frontend, tokenizer, req.request_id, tokenizer.encode(str(req.prompt)))
        running.append(gen)
        return gen  # no engine answers: it runs until aborted

    frontend.submit = submit

    async def scenario() -> tuple[Aborted, Aborted, Aborted]:
        call = asyncio.create_task(generate(service, prompt_request("Hi", "job"), Context()))
        while "job" not in service.running:
            await asyncio.sleep(0.01)
        with pytest.raises(Aborted) as duplicate:
            await generate(service, prompt_request("Hi", "job"), Context())
        assert len(running) == 1  # the duplicate was refused before it was submitted
        await service.Abort(pb.AbortRequest(request_id="job"), Context())
        with pytest.raises(Aborted) as ended:
            await asyncio.wait_for(call, 5)
        with pytest.raises(Aborted) as unknown:
            await service.Abort(pb.AbortRequest(request_id="job"), Context())
        return duplicate.value, ended.value, unknown.value

    duplicate, ended, unknown = asyncio.run(scenario())
    assert duplicate.code == grpc.StatusCode.ALREADY_EXISTS
    assert ended.code == grpc.StatusCode.CANCELLED and "Abort" in ended.details
    assert unknown.code == grpc.StatusCode.NOT_FOUND  # it is no longer running
    assert service.running == {} and frontend.num_in_flight == 0
    assert recorder.aborted_ids == {running[0].request_id}  # the engine is told to stop it


def test_a_client_id_is_claimed_before_submit_returns(setup: Any, tokenizer: Any) -> None:
    """Two calls with one id, the first still inside a slow submit: the second is refused, never submitted."""
    service, frontend, _, recorder = setup
    submitted: list[Generation] = []
    release = asyncio.Event()

    async def slow_submit(req: CompletionRequest, stop: list[str], n: int, text: Any = None) -> Generation:
        gen = open_generation(frontend, tokenizer, req.request_id, tokenizer.encode(str(req.prompt)))
        submitted.append(gen)
        await release.wait()  # the call is past the id check but not yet running
        return gen

    frontend.submit = slow_submit

    async def scenario() -> Aborted:
        first = asyncio.create_task(generate(service, prompt_request("Hi", "twin"), Context()))
        while not submitted:
            await asyncio.sleep(0.01)
        with pytest.raises(Aborted) as duplicate:  # at once: it must not wait on the first call's submit
            await asyncio.wait_for(generate(service, prompt_request("Hi", "twin"), Context()), 5)
        release.set()
        while "twin" not in service.running:
            await asyncio.sleep(0.01)
        await service.Abort(pb.AbortRequest(request_id="twin"), Context())
        with pytest.raises(Aborted):
            await asyncio.wait_for(first, 5)
        return duplicate.value

    duplicate = asyncio.run(scenario())
    assert duplicate.code == grpc.StatusCode.ALREADY_EXISTS
    assert len(submitted) == 1  # the second call never reached the engine
    assert recorder.aborted_ids == {submitted[0].request_id}  # Abort found the first call's generation
    assert service.running == {} and service.claimed == set() and frontend.num_in_flight == 0


def test_list_models_names_the_servable_ones(setup: Any) -> None:
    service, frontend, _, _ = setup
    engine = EngineHeartbeat("e1", "m", 4096)
    frontend.registry.models = {
        "m": ModelEntry("m", [engine], [TokenizerHeartbeat("t1", "m")], first_seen=1700000000.7),
        "no-tokenizer": ModelEntry("no-tokenizer", [EngineHeartbeat("e2", "no-tokenizer", 512)]),
        "gone": ModelEntry("gone"),
    }
    reply = asyncio.run(service.ListModels(pb.ListModelsRequest(), Context()))
    assert [(m.id, m.max_model_len, m.created) for m in reply.models] == [("m", 4096, 1700000000)]


def test_the_server_answers_generate_and_health_on_its_port(setup: Any) -> None:
    _, frontend, _, _ = setup
    settings = frontend.settings

    async def scenario() -> tuple[list[int], list[Any]]:
        door = await start(frontend, settings)
        try:
            async with grpc.aio.insecure_channel(f"{settings.host}:{settings.grpc_port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                statuses = [
                    (await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status
                    for name in ("", SERVICE_NAME)
                ]
                stub = pb_grpc.GenerationStub(channel)
                call: AsyncIterator[Any] = stub.Generate(prompt_request("Hi", n=2), metadata=AUTH, timeout=10)
                responses = [r async for r in call]
        finally:
            await door.stop()
        return statuses, responses

    statuses, responses = asyncio.run(scenario())
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 2
    assert sorted(r.text for r in responses) == [" choice 0", " choice 1"]
    assert [r.HasField("usage") for r in responses] == [False, True]
    assert responses[-1].usage.completion_tokens == sum(len(r.token_ids) for r in responses)
