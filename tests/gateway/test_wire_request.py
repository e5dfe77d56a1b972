"""One request builder for HTTP and gRPC: the same API request gives the same tokenizer message."""

from __future__ import annotations

import pytest
from google.protobuf import struct_pb2

from pagedserve.services.engine.service import sampling_params_from_wire
from pagedserve.services.gateway import schemas
from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.grpc_api import convert
from pagedserve.services.gateway.grpc_api import pagedserve_pb2 as pb
from pagedserve.services.gateway.validation import validate
from pagedserve.services.gateway.wire_request import to_wire
from pagedserve.shared.config import GatewayConfig
from pagedserve.shared.protocol import ChatRequest, CompletionRequest

TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "description": "d",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_chat_request_carries_template_kwargs_tools_and_trace() -> None:
    req = validate(
        schemas.ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.5,
            "max_tokens": 9,
            "tools": [TOOL],
            "chat_template_kwargs": {"enable_thinking": False},
            "stream": True,
        },
    )
    wire = to_wire(req, "chatcmpl-1", "gw-1", TRACEPARENT)
    assert isinstance(wire, ChatRequest)
    assert (wire.request_id, wire.reply_to, wire.model, wire.max_tokens, wire.stream) == (
        "chatcmpl-1",
        "gw-1",
        "m",
        9,
        True,
    )
    assert wire.messages == [{"role": "user", "content": "hi"}] and wire.sampling["temperature"] == 0.5
    assert wire.chat_template_kwargs == {"enable_thinking": False} and wire.tools == [TOOL]
    assert wire.traceparent == TRACEPARENT and wire.arrival_time > 0


def test_a_completion_request_takes_the_prompt_asked_for() -> None:
    req = validate(schemas.CompletionRequest, {"model": "m", "prompt": ["a", "b"], "max_tokens": 3})
    first, second = (to_wire(req, f"cmpl-{i}", "gw", prompt=p) for i, p in enumerate(req.prompts))
    assert isinstance(first, CompletionRequest) and isinstance(second, CompletionRequest)
    assert (first.prompt, second.prompt, second.request_id, second.max_tokens) == ("a", "b", "cmpl-1", 3)
    assert to_wire(req, "x", "gw").prompt == "a"


def test_grpc_builds_what_http_builds() -> None:
    kwargs = struct_pb2.Struct()
    kwargs.update({"enable_thinking": True})
    tool = struct_pb2.Struct()
    tool.update(TOOL)
    request = pb.GenerateRequest(
        model="m",
        chat=pb.ChatMessages(
            messages=[pb.ChatMessage(role="user", content="hi")], chat_template_kwargs=kwargs, tools=[tool]
        ),
        sampling=pb.SamplingParams(temperature=0.5, max_tokens=9),
    )
    settings = GatewayConfig(gateway_id="gw-1")
    from_grpc = convert.to_wire(convert.to_api_request(request, settings), "grpc-1", settings, TRACEPARENT)
    from_http = to_wire(
        validate(
            schemas.ChatCompletionRequest,
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "temperature": 0.5,
                "max_tokens": 9,
                "tools": [TOOL],
                "chat_template_kwargs": {"enable_thinking": True},
                "stream": True,
            },
        ),
        "grpc-1",
        "gw-1",
        TRACEPARENT,
    )
    from_grpc.arrival_time = from_http.arrival_time
    assert from_grpc == from_http


def test_priority_reaches_the_engine() -> None:
    req = validate(schemas.CompletionRequest, {"model": "m", "prompt": "x", "priority": -3})
    assert schemas.sampling_dict(req)["priority"] == -3
    plain = validate(schemas.CompletionRequest, {"model": "m", "prompt": "x"})
    assert "priority" not in schemas.sampling_dict(plain)  # an older engine still takes it
    assert sampling_params_from_wire(schemas.sampling_dict(req)).priority == -3


def test_chat_template_extensions_travel_with_the_request() -> None:
    req = validate(
        schemas.ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
            "documents": [{"title": "t", "text": "x"}],
            "reasoning_effort": "high",
        },
    )
    wire = to_wire(req, "c", "gw")
    assert (wire.add_generation_prompt, wire.continue_final_message) == (False, True)
    assert wire.documents == [{"title": "t", "text": "x"}]
    assert wire.chat_template_kwargs == {"reasoning_effort": "high"}  # templates that read it get it


@pytest.mark.parametrize(
    "body",
    [
        {"continue_final_message": True},  # add_generation_prompt defaults to true
        {
            "continue_final_message": True,
            "add_generation_prompt": False,
            "messages": [{"role": "user", "content": "x"}],
        },
    ],
)
def test_continue_final_message_needs_an_open_assistant_turn(body: dict[str, object]) -> None:
    full = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
        **body,
    }
    with pytest.raises(APIError) as err:
        validate(schemas.ChatCompletionRequest, full)
    assert err.value.status == 400 and err.value.param == "continue_final_message"
