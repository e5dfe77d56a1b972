from __future__ import annotations

import dataclasses

import msgpack
import pytest

from pagedserve.shared.protocol import (
    SCHEMA_VERSION,
    Abort,
    Accepted,
    ChatRequest,
    CompletionRequest,
    DecodeError,
    EngineHeartbeat,
    GenerateRequest,
    KVEvents,
    LoRAUpdate,
    Message,
    RequestError,
    TokenDeltas,
    TokenizerHeartbeat,
    decode,
    decode_as,
    encode,
)

SAMPLES = [
    ChatRequest(
        "r1",
        "gw-1",
        "m",
        [{"role": "user", "content": "hé 😀"}],
        {"temperature": 0.5, "n": 2},
        max_tokens=7,
        stream=True,
        arrival_time=1.5,
        traceparent="00-ab-cd-01",
    ),
    CompletionRequest("r2", "gw-1", "m", [1, 2, 3], {"seed": 2**63 - 1}, max_tokens=None),
    CompletionRequest("r3", "gw-1", "m", "text prompt"),
    GenerateRequest(
        "r4", "gw-2", "m", [5, 6], {"max_tokens": 3, "logit_bias": {"5": -100.0}}, output_token_ids=[9, 10]
    ),
    Accepted("r5", 12, 100, prompt_token_ids=list(range(12))),
    RequestError("r6", 400, "too long", param="messages", code="context_length_exceeded"),
    TokenDeltas(
        "e1",
        3,
        ["a", "b"],
        [0, 1],
        [[1], [2, 3]],
        [None, [[-0.1, [[2, -0.1], [4, -2.5]]]]],
        [None, "stop"],
        [5, 5],
        [1, 2],
        [0, 4],
    ),
    Abort(["a", "b"], reason="client disconnected"),
    LoRAUpdate("u1", "load", "sql", "/adapters/sql"),
    EngineHeartbeat(
        "e1", "m", 2048, num_running=3, model_source="/models/x", lora_adapters={"sql": "/a/sql"}, lora_resident=["sql"]
    ),
    TokenizerHeartbeat("tok-1", "m", 1700000000.5),
    KVEvents("e1", 16, [2**64 - 1, 7], [3], snapshot=False),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: Message) -> None:
    data = encode(msg)
    back = decode(data)
    assert back == msg
    assert type(back) is type(msg)
    assert msgpack.unpackb(data)["t"] == type(msg).TAG


def test_every_message_type_is_sampled() -> None:
    from pagedserve.shared import protocol

    assert {type(m).TAG for m in SAMPLES} == set(protocol._TYPES)  # type: ignore[attr-defined]


def test_unknown_fields_from_a_newer_producer_are_ignored() -> None:
    raw = msgpack.packb({"v": SCHEMA_VERSION, "t": "abort", "request_ids": ["x"], "reason": "r", "future": 1})
    assert decode(raw) == Abort(["x"], "r")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1\xff garbage",
        msgpack.packb([1, 2]),
        msgpack.packb({"v": 99, "t": "abort", "request_ids": []}),
        msgpack.packb({"v": SCHEMA_VERSION, "t": "nope"}),
        msgpack.packb({"v": SCHEMA_VERSION, "t": "abort"}),
        msgpack.packb({1: 2}),
        b"\x80" * 10,
    ],
)
def test_garbage_raises_decode_error_only(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode(data)


def test_decode_as_checks_the_type() -> None:
    with pytest.raises(DecodeError):
        decode_as(encode(Abort(["x"])), Accepted)
    assert decode_as(encode(Abort(["x"])), Abort).request_ids == ["x"]


def test_messages_are_slots_dataclasses() -> None:
    for msg in SAMPLES:
        assert dataclasses.is_dataclass(msg) and not hasattr(msg, "__dict__")
