"""/v1/responses requests become the chat request the pipeline serves."""

from __future__ import annotations

import pytest

from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.responses_api import ResponsesRequest, chat_request_of


def test_input_and_instructions_become_chat_messages() -> None:
    req = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "Be brief.",
            "max_output_tokens": 7,
            "temperature": 0.3,
            "reasoning": {"effort": "low"},
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Hel"}, {"type": "input_text", "text": "lo"}],
                },
                {"type": "message", "role": "assistant", "content": "Hi"},
                {"role": "user", "content": "Paris?"},
            ],
        }
    )
    chat = chat_request_of(req)
    assert [m.as_template_input() for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "Paris?"},
    ]
    assert (chat.token_budget, chat.temperature, chat.reasoning_effort) == (7, 0.3, "low")
    plain = chat_request_of(ResponsesRequest.model_validate({"model": "m", "input": "Paris?"}))
    assert [m.as_template_input() for m in plain.messages] == [{"role": "user", "content": "Paris?"}]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
    ],
)
def test_what_is_not_served_is_refused_naming_the_field(fields: dict[str, object], param: str) -> None:
    with pytest.raises(APIError) as err:
        chat_request_of(ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields}))
    assert err.value.status == 400 and err.value.param == param
