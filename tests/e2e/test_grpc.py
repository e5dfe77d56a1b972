"""The gRPC front door with a real gRPC client against the real services: a second gateway process
(with an API key and a gRPC port) on the session's Redis and engine."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.services.gateway.grpc_api import pagedserve_pb2 as pb
from pagedserve.services.gateway.grpc_api import pagedserve_pb2_grpc as pb_grpc
from tests.conftest import RunningServices, start_service, stop_all, wait_ready
from tests.e2e.test_reliability import _engine_load, _wait_idle

KEY = "grpc-test-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def channel(services: RunningServices, tmp_path_factory: pytest.TempPathFactory) -> Iterator[grpc.Channel]:
    from pagedserve.shared.redis_server import free_port

    http_port, grpc_port = free_port(), free_port()
    log_dir: Path = tmp_path_factory.mktemp("grpc-gateway")
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": services.redis_url}
    args = ["gateway", "--host", "127.0.0.1", "--port", str(http_port), "--grpc-port", str(grpc_port), "--api-key", KEY]
    processes = {"gateway": start_service("gateway", args, env, log_dir)}
    try:
        wait_ready(f"http://127.0.0.1:{http_port}", processes)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as chan:
            yield chan
    finally:
        stop_all(processes)
        print("----- grpc gateway log (tail) -----\n" + (log_dir / "gateway.log").read_text()[-3000:])


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(channel)


def _chat(model: str, **sampling: Any) -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in QUESTION]
    return pb.GenerateRequest(
        model=model, chat=pb.ChatMessages(messages=messages), sampling=pb.SamplingParams(**sampling)
    )


def test_health_is_serving_without_a_key(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pagedserve.v1.Generation"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_list_models(stub: pb_grpc.GenerationStub, services: RunningServices) -> None:
    reply = stub.ListModels(pb.ListModelsRequest(), metadata=AUTH, timeout=10)
    assert [m.id for m in reply.models] == [services.model] and reply.models[0].max_model_len > 0


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", KEY),)])
def test_a_bad_key_is_unauthenticated(
    stub: pb_grpc.GenerationStub, services: RunningServices, metadata: tuple[tuple[str, str], ...]
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(_chat(services.model, max_tokens=2), metadata=metadata, timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_streaming_generate_equals_http_greedy(stub: pb_grpc.GenerationStub, services: RunningServices) -> None:
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300)
    http_chat = client.chat.completions.create(model=services.model, messages=QUESTION, temperature=0, max_tokens=16)
    http_text = client.completions.create(
        model=services.model, prompt="The capital of France is", temperature=0, max_tokens=8, logprobs=2
    )

    responses = list(stub.Generate(_chat(services.model, temperature=0, max_tokens=16), metadata=AUTH, timeout=300))
    assert len(responses) > 2  # streamed, not one message
    assert "".join(r.text for r in responses) == http_chat.choices[0].message.content
    assert responses[-1].finish_reason == http_chat.choices[0].finish_reason
    assert responses[-1].usage.completion_tokens == http_chat.usage.completion_tokens
    assert sum(len(r.token_ids) for r in responses) == http_chat.usage.completion_tokens

    request = pb.GenerateRequest(
        model=services.model,
        prompt="The capital of France is",
        sampling=pb.SamplingParams(temperature=0, max_tokens=8, logprobs=2),
    )
    responses = list(stub.Generate(request, metadata=AUTH, timeout=300))
    assert "".join(r.text for r in responses) == http_text.choices[0].text
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert [lp.token for lp in logprobs] == http_text.choices[0].logprobs.tokens
    assert [lp.logprob for lp in logprobs] == pytest.approx(http_text.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_tools_reach_the_chat_template_as_over_http(stub: pb_grpc.GenerationStub, services: RunningServices) -> None:
    """One request builder for both front doors: the same tools give the same prompt over gRPC and HTTP."""
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300)
    plain = client.chat.completions.create(model=services.model, messages=QUESTION, temperature=0, max_tokens=1)
    http = client.chat.completions.create(
        model=services.model,
        messages=QUESTION,
        temperature=0,
        max_tokens=1,
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
    )
    assert http.usage is not None and plain.usage is not None
    assert http.usage.prompt_tokens > plain.usage.prompt_tokens  # the template rendered the tool
    tool = struct_pb2.Struct()
    tool.update(WEATHER_TOOL)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in QUESTION], tools=[tool])
    request = pb.GenerateRequest(
        model=services.model, chat=chat, sampling=pb.SamplingParams(temperature=0, max_tokens=1)
    )
    responses = list(stub.Generate(request, metadata=AUTH, timeout=300))
    assert responses[-1].usage.prompt_tokens == http.usage.prompt_tokens


@pytest.mark.parametrize(
    ("request_fields", "sampling", "code", "named"),
    [
        ({"prompt": "hi"}, {"temperature": 5.0}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        ({"prompt": "hi"}, {"n": 1000}, grpc.StatusCode.INVALID_ARGUMENT, "n"),
        ({"prompt": "hi"}, {"logit_bias": {"not-a-token": 1.0}}, grpc.StatusCode.INVALID_ARGUMENT, "logit_bias"),
        ({"chat": pb.ChatMessages()}, {}, grpc.StatusCode.INVALID_ARGUMENT, "messages"),
        (
            {"chat": pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="x")])},
            {},
            grpc.StatusCode.INVALID_ARGUMENT,
            "messages[0].role",
        ),
        ({}, {}, grpc.StatusCode.INVALID_ARGUMENT, "input"),
        ({"prompt": "hi " * 3000}, {}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),  # longer than the context
        ({"prompt": "hi", "model": "no-such-model"}, {}, grpc.StatusCode.NOT_FOUND, "model"),
    ],
)
def test_bad_input_is_invalid_argument(
    stub: pb_grpc.GenerationStub,
    services: RunningServices,
    request_fields: dict[str, Any],
    sampling: dict[str, Any],
    code: grpc.StatusCode,
    named: str,
) -> None:
    request = pb.GenerateRequest(**{"model": services.model, **request_fields}, sampling=pb.SamplingParams(**sampling))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, metadata=AUTH, timeout=60))
    assert err.value.code() == code
    assert f"param: {named})" in err.value.details(), err.value.details()


def _long_generation(model: str, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        model=model,
        request_id=request_id,
        prompt="Once upon a time",
        sampling=pb.SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True),
    )


def _read_until_running(responses: Any, services: RunningServices, idle_free: int) -> None:
    """Read the stream until a heartbeat (once a second) shows the sequence holding KV blocks."""
    deadline = time.monotonic() + 30
    for response in responses:
        assert response.token_ids
        busy = _engine_load(services)
        if busy.num_running == 1 and busy.num_free_blocks < idle_free:
            return
        assert time.monotonic() < deadline, f"the request never showed in the engine's load: {busy}"


def test_a_cancelled_call_frees_its_kv_blocks(stub: pb_grpc.GenerationStub, services: RunningServices) -> None:
    idle = _wait_idle(services, _engine_load(services).num_total_blocks, 30)
    call = stub.Generate(_long_generation(services.model), metadata=AUTH, timeout=300)
    _read_until_running(call, services, idle.num_free_blocks)
    call.cancel()
    started = time.monotonic()
    _wait_idle(services, idle.num_free_blocks, timeout_s=10)
    assert time.monotonic() - started < 10
    assert call.code() == grpc.StatusCode.CANCELLED


def test_abort_by_request_id_frees_its_kv_blocks(stub: pb_grpc.GenerationStub, services: RunningServices) -> None:
    idle = _wait_idle(services, _engine_load(services).num_total_blocks, 30)
    call = stub.Generate(_long_generation(services.model, "my-request-1"), metadata=AUTH, timeout=300)
    _read_until_running(call, services, idle.num_free_blocks)
    stub.Abort(pb.AbortRequest(request_id="my-request-1"), metadata=AUTH, timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    _wait_idle(services, idle.num_free_blocks, timeout_s=10)
    with pytest.raises(grpc.RpcError) as err:
        stub.Abort(pb.AbortRequest(request_id="my-request-1"), metadata=AUTH, timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
