"""Chat messages as templates get them; response pieces in the OpenAI shapes."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pagedserve.services.gateway import responses
from pagedserve.services.gateway.messages import ChatMessage


def test_messages_become_template_input() -> None:
    parts = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}
    )
    assert parts.as_template_input() == {"role": "user", "content": "Hello"}
    call = ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        }
    )
    assert call.as_template_input() == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
    }  # a mapping
    tool = ChatMessage.model_validate({"role": "tool", "content": "22C", "tool_call_id": "c1"})
    assert tool.as_template_input() == {"role": "tool", "content": "22C", "tool_call_id": "c1"}


@pytest.mark.parametrize(
    "body",
    [
        {"role": "user"},  # no content
        {"role": "user", "content": "x", "tool_calls": []},  # an empty list is fine, so: a real one below
        {"role": "robot", "content": "x"},
        {"role": "user", "content": 5},  # strict: no coercion
        {"role": "user", "content": "x", "extra": 1},
    ],
)
def test_bad_messages_are_refused(body: dict[str, object]) -> None:
    if body.get("tool_calls") == []:
        body = {**body, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}]}
    with pytest.raises(ValidationError):
        ChatMessage.model_validate(body)


def test_sse_events_and_merged_logprobs() -> None:
    assert responses.sse("[DONE]") == b"data: [DONE]\n\n"
    event = responses.sse({"a": [1, "é"]})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and json.loads(event[6:]) == {"a": [1, "é"]}
    total = responses.merge_logprobs(None, {"tokens": ["a"], "token_logprobs": [-1.0], "text_offset": [0]})
    total = responses.merge_logprobs(total, {"tokens": ["b"], "token_logprobs": [-2.0], "text_offset": [1]})
    assert total == {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "text_offset": [0, 1]}
    assert responses.merge_logprobs(total, None) is total
