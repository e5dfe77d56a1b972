"""Request schemas: strict types, the param path of every error, caps, unknown fields (refused by
`validate`, dropped and named by `validate_ignoring_unknown`), and the engine's sampling dict."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from pagedserve.services.gateway import ignored_fields, schemas
from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.validation import param_path, validate, validate_ignoring_unknown
from pagedserve.shared.config import GatewayConfig

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SETTINGS = GatewayConfig(max_n=4, max_stop=2, max_logit_bias=2, max_messages=3)


def chat_error(**fields: Any) -> APIError:
    with pytest.raises(APIError) as err:
        req = validate(schemas.ChatCompletionRequest, {**CHAT, **fields})
        schemas.check_limits(req, SETTINGS)
    return err.value


def completion_error(**fields: Any) -> APIError:
    with pytest.raises(APIError) as err:
        req = validate(schemas.CompletionRequest, {"model": "m", "prompt": "p", **fields})
        schemas.check_limits(req, SETTINGS)
    return err.value


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"temperature": "1"}, "temperature", "invalid_type"),  # no coercion from strings
        ({"temperature": 2.5}, "temperature", "invalid_value"),
        ({"top_p": 0}, "top_p", "invalid_value"),
        ({"top_k": -2}, "top_k", "invalid_value"),
        ({"min_p": 1.5}, "min_p", "invalid_value"),
        ({"presence_penalty": -3}, "presence_penalty", "invalid_value"),
        ({"frequency_penalty": 2.1}, "frequency_penalty", "invalid_value"),
        ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
        ({"n": 0}, "n", "invalid_value"),
        ({"n": True}, "n", "invalid_type"),  # a bool is not an int here
        ({"n": 2.0}, "n", "invalid_type"),
        ({"seed": 2**63}, "seed", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"max_tokens": 10**30}, "max_tokens", "invalid_value"),  # would not fit the wire
        ({"max_completion_tokens": -1}, "max_completion_tokens", "invalid_value"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "invalid_value"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
        ({"logit_bias": {"-5": 1}}, "logit_bias", "invalid_value"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
        ({"stop": ""}, "stop", "invalid_value"),
        ({"stop": [1]}, "stop[0]", "invalid_type"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]", "invalid_value"),
        ({"messages": []}, "messages", "invalid_value"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
        ({"messages": [{"role": "user"}]}, "messages[0]", "invalid_value"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "missing_required_parameter"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
            "invalid_value",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "x",
                        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
            "missing_required_parameter",
        ),
        ({"unknown_field": 1}, "unknown_field", "unknown_parameter"),  # validate refuses them (strict mode)
        (
            {"stream_options": {"include_usage": True, "bogus": 1}, "stream": True},
            "stream_options.bogus",
            "unknown_parameter",
        ),
        ({"model": ""}, "model", "invalid_value"),
        ({"model": None}, "model", "invalid_type"),
    ],
)
def test_schema_errors_name_the_param(fields: dict[str, Any], param: str, code: str) -> None:
    err = chat_error(**fields)
    assert (err.status, err.type, err.param, err.code) == (400, "invalid_request_error", param, code), err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 5}, "n"),
        ({"stop": ["a", "b", "c"]}, "stop"),
        ({"stop_token_ids": [1, 2, 3]}, "stop_token_ids"),
        ({"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}] * 4}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs=true
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format",
        ),  # not a JSON schema
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # only with stream=true
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ],
)
def test_caps_and_cross_field_rules(fields: dict[str, Any], param: str) -> None:
    err = chat_error(**fields)
    assert (err.status, err.param) == (400, param), err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": ["a", [1]]}, "prompt"),
        ({"prompt": [[1], [-1]]}, "prompt"),
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": ["a"] * 20, "n": 4}, "prompt"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "x"}, "suffix"),
    ],
)
def test_completion_errors(fields: dict[str, Any], param: str) -> None:
    err = completion_error(**fields)
    assert (err.status, err.param) == (400, param), err.message


def test_single_prompt_forms_are_unwrapped() -> None:
    assert validate(schemas.CompletionRequest, {"model": "m", "prompt": ["text"]}).prompt == "text"
    assert validate(schemas.CompletionRequest, {"model": "m", "prompt": [[1, 2]]}).prompt == [1, 2]
    assert validate(schemas.CompletionRequest, {"model": "m", "prompt": [3, 4]}).prompt == [3, 4]


def test_batches_and_echo_logprobs_reach_the_engine() -> None:
    batch = validate(schemas.CompletionRequest, {"model": "m", "prompt": [[1, 2], [3]], "echo": True, "logprobs": 2})
    assert batch.prompts == [[1, 2], [3]]
    assert validate(schemas.CompletionRequest, {"model": "m", "prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert schemas.sampling_dict(batch)["prompt_logprobs"] == 2  # echo + logprobs: the prompt's logprobs
    both = validate(
        schemas.CompletionRequest, {"model": "m", "prompt": "a", "echo": True, "logprobs": 1, "prompt_logprobs": 4}
    )
    assert schemas.sampling_dict(both)["prompt_logprobs"] == 4
    plain = validate(schemas.CompletionRequest, {"model": "m", "prompt": "a", "logprobs": 1})
    assert "prompt_logprobs" not in schemas.sampling_dict(plain)  # older engines never see the key


def test_non_object_bodies_are_400() -> None:
    bodies: list[Any] = [[], "text", 3, None]
    for body in bodies:
        with pytest.raises(APIError) as err:
            validate(schemas.ChatCompletionRequest, body)
        assert err.value.status == 400 and err.value.param is None


def test_nulls_mean_defaults_and_assistant_echoes_are_accepted() -> None:
    req = validate(
        schemas.ChatCompletionRequest,
        {
            **CHAT,
            "n": None,
            "stream": None,
            "logprobs": None,
            "temperature": None,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c", "refusal": None, "tool_calls": None},
            ],
        },
    )
    assert (req.num_choices, req.is_stream, req.num_logprobs) == (1, False, None)
    assert [m.as_template_input() for m in req.messages] == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c"},
    ]


def test_sampling_dict_maps_every_parameter() -> None:
    req = validate(
        schemas.ChatCompletionRequest,
        {
            **CHAT,
            "n": 2,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 7,
            "min_p": 0.1,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "seed": -3,
            "stop_token_ids": [5],
            "min_tokens": 2,
            "ignore_eos": True,
            "logit_bias": {"9": -100},
            "logprobs": True,
            "top_logprobs": 3,
            "max_completion_tokens": 7,
            "max_tokens": 99,
        },
    )
    assert schemas.sampling_dict(req) == {
        "n": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "seed": -3,
        "stop_token_ids": [5],
        "min_tokens": 2,
        "ignore_eos": True,
        "logit_bias": {"9": -100.0},
        "logprobs": 3,
    }
    assert req.token_budget == 7  # max_completion_tokens wins over the deprecated max_tokens
    defaults = schemas.sampling_dict(validate(schemas.ChatCompletionRequest, {**CHAT, "top_k": -1}))
    assert (defaults["top_k"], defaults["logprobs"], defaults["n"]) == (0, None, 1)
    assert "seed" not in defaults and "logit_bias" not in defaults
    # Unset sampling fields stay off the wire: the model's generation_config.json may default them.
    assert not {"temperature", "top_p", "min_p", "repetition_penalty"} & defaults.keys()


def test_param_path() -> None:
    names = {"messages", "content", "type"}
    assert param_path(("messages", 0, "content", "list[TextPart]", 1, "type"), names) == "messages[0].content[1].type"
    assert param_path(("messages", 2), names) == "messages[2]"
    assert param_path((), names) is None


NOT_APPLICABLE = {
    "store": True,
    "metadata": {"k": "v"},
    "service_tier": "flex",
    "parallel_tool_calls": False,
    "user": "u",
    "prompt_cache_key": "p",
    "safety_identifier": "s",
    "reasoning_effort": "high",
    "verbosity": "low",
    "modalities": ["text"],
    "prediction": {"type": "content", "content": "x"},
    "audio": {"voice": "alloy"},
    "web_search_options": {"search_context_size": "low"},
}


def test_openai_fields_that_do_not_apply_are_known_and_typed() -> None:
    validate(schemas.ChatCompletionRequest, {**CHAT, **NOT_APPLICABLE})  # strict: not unknown
    for name in ("store", "metadata", "modalities", "prediction"):
        assert chat_error(**{name: 5}).param == name


def test_unknown_fields_are_dropped_and_named_wherever_they_are() -> None:
    body: dict[str, Any] = {
        **CHAT,
        "frobnicate": 1,
        "stream": True,
        "stream_options": {"include_usage": True, "bogus": 1},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}], "x": 1}],
        "tool_choice": {"type": "function", "function": {"name": "f", "strict": True}, "z": 2},
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}, "q": 0}},
    }
    req, ignored = validate_ignoring_unknown(schemas.ChatCompletionRequest, body)
    assert sorted(ignored) == [
        "frobnicate",
        "messages[0].content[0].cache_control",
        "messages[0].x",
        "response_format.json_schema.q",
        "stream_options.bogus",
        "tool_choice.function.strict",
        "tool_choice.z",
    ]
    assert req.include_usage and req.messages[0].as_template_input()["content"] == "a"
    assert isinstance(req.tool_choice, schemas.NamedToolChoice) and req.tool_choice.function.name == "f"
    assert body["frobnicate"] == 1 and "x" in body["messages"][0]  # the caller's body is left as it was
    assert validate_ignoring_unknown(schemas.CompletionRequest, {"model": "m", "prompt": "p"})[1] == []
    _, ignored = validate_ignoring_unknown(schemas.CompletionRequest, {"model": "m", "prompt": "p", "store": 1})
    assert ignored == ["store"]  # a chat field, unknown to completions: any type goes


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": "1", "frobnicate": 1}, "temperature"),
        ({"store": "yes", "frobnicate": 1}, "store"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
        ),  # an image part is not a text part with an unknown field
        ({"messages": [{"role": "wizard", "content": "x", "x": 1}]}, "messages[0].role"),
    ],
)
def test_wrong_types_are_still_400_when_unknown_fields_are_ignored(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as err:
        validate_ignoring_unknown(schemas.ChatCompletionRequest, {**CHAT, **fields})
    assert (err.value.status, err.value.param) == (400, param), err.value.message


def test_ignored_fields_header_is_bounded_plain_ascii() -> None:
    assert ignored_fields.header_value(["a", "messages[0].b"]) == "a, messages[0].b"
    assert ignored_fields.header_value(["x y,\r\né" + "z" * 100]) == "x?y????" + "z" * 57
    many = ignored_fields.header_value([f"f{i}" for i in range(20)])
    assert many.startswith("f0, f1") and many.endswith("f15, ... (4 more)")


def test_ignored_fields_are_logged_once_per_name(caplog: pytest.LogCaptureFixture) -> None:
    warned = ignored_fields.IgnoredFieldsLog()
    with caplog.at_level(logging.WARNING, logger=ignored_fields.__name__):
        warned.warn("/v1/chat/completions", ["store_x", "messages[0].x"])
        warned.warn("/v1/chat/completions", ["messages[3].x", "store_x"])  # same names: no line
        warned.warn("/v1/completions", ["other"])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "messages[].x, store_x" in lines[0] and "other" in lines[1]
