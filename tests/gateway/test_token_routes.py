"""POST /tokenize and /detokenize through the real app, with the model's tokenizer (SmolLM2's) served
by a stand-in for `Frontend.tokenizer_of` (no Redis, no engine): the ids are the tokenizer's own, chat
ids are the chat template's, and bad input is a 400 naming the field."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from pagedserve.services.gateway.app import build_app
from pagedserve.services.gateway.errors import model_not_found
from pagedserve.services.gateway.token_routes import Detokenize, TokenizeChat, TokenizeText
from pagedserve.shared.prompts import chat_prompt_ids
from pagedserve.shared.tokenizer_loader import load_tokenizer
from tests.gateway.gateway_helpers import offline_config

MAX_MODEL_LEN = 2048
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def failing_template_tokenizer(smollm2_dir: Path) -> Any:
    return load_tokenizer(smollm2_dir, "{{ raise_exception('secret template detail') }}")


class BosTokenizer:
    """SmolLM2's tokenizer as one that adds a BOS token (as Llama's does) unless told not to."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return [self.tokenizer.bos_token_id, *ids] if add_special_tokens else ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def client(tokenizer: Any, failing_template_tokenizer: Any) -> TestClient:
    app = build_app(offline_config(max_messages=3))
    served = {"m": tokenizer, "bos": BosTokenizer(tokenizer), "broken": failing_template_tokenizer}

    async def tokenizer_of(model: str) -> tuple[Any, int]:
        if model not in served:
            raise model_not_found(model)
        return served[model], MAX_MODEL_LEN

    app.state.frontend.tokenizer_of = tokenizer_of
    return TestClient(app)  # no lifespan: nothing reads Redis


def call(client: TestClient, route: str, status: int = 200, **body: Any) -> dict[str, Any]:
    response = client.post(route, json=body)
    assert response.status_code == status, response.text
    result: dict[str, Any] = response.json()
    return result


def error_param(client: TestClient, route: str, **body: Any) -> str | None:
    error = call(client, route, 400, **body)["error"]
    assert error["type"] == "invalid_request_error"
    param: str | None = error["param"]
    return param


def test_a_text_prompt_gets_the_tokenizers_ids(client: TestClient, tokenizer: Any) -> None:
    text = "Paris is the capital of France."
    body = call(client, "/tokenize", model="m", prompt=text)
    ids = tokenizer.encode(text)
    assert body == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
    with_strs = call(client, "/tokenize", model="m", prompt=text, return_token_strs=True)
    assert with_strs["token_strs"] == tokenizer.convert_ids_to_tokens(ids)


def test_add_special_tokens_reaches_the_tokenizer(client: TestClient, tokenizer: Any) -> None:
    text = "Hello"
    added = call(client, "/tokenize", model="bos", prompt=text)["tokens"]
    plain = call(client, "/tokenize", model="bos", prompt=text, add_special_tokens=False)["tokens"]
    assert plain == tokenizer.encode(text) and added == [tokenizer.bos_token_id, *plain]


def test_chat_messages_get_the_chat_templates_ids(client: TestClient, tokenizer: Any) -> None:
    body = call(client, "/tokenize", model="m", messages=MESSAGES)
    assert body["tokens"] == chat_prompt_ids(tokenizer, MESSAGES, {}, True) and body["count"] == len(body["tokens"])
    bare = call(client, "/tokenize", model="m", messages=MESSAGES, add_generation_prompt=False)["tokens"]
    assert bare == chat_prompt_ids(tokenizer, MESSAGES, {}, False)
    assert body["tokens"][: len(bare)] == bare and len(body["tokens"]) > len(bare)  # + the assistant's header


def test_chat_input_errors_name_the_field(client: TestClient) -> None:
    too_many = [{"role": "user", "content": str(i)} for i in range(4)]  # max_messages is 3 here
    assert error_param(client, "/tokenize", model="m", messages=too_many) == "messages"
    reserved = {"tokenize": False}  # would change what apply_chat_template returns
    assert error_param(client, "/tokenize", model="m", messages=MESSAGES, chat_template_kwargs=reserved) == (
        "chat_template_kwargs"
    )
    error = call(client, "/tokenize", 400, model="broken", messages=MESSAGES)["error"]
    assert error["param"] == "messages" and "secret template detail" not in error["message"]  # logged, not sent
    assert call(client, "/tokenize", 404, model="nope", prompt="x")["error"]["param"] == "model"


def test_detokenize_round_trips_and_refuses_ids_outside_the_vocabulary(client: TestClient, tokenizer: Any) -> None:
    text = "Hello, world!"
    assert call(client, "/detokenize", model="m", tokens=tokenizer.encode(text)) == {"prompt": text}
    vocab = len(tokenizer)
    error = call(client, "/detokenize", 400, model="m", tokens=[1, vocab])["error"]
    assert error["param"] == "tokens" and str(vocab) in error["message"]
    assert call(client, "/detokenize", model="m", tokens=[vocab - 1])["prompt"] == tokenizer.decode([vocab - 1])


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (TokenizeText, {"model": "", "prompt": "x"}),  # an empty model name
        (TokenizeChat, {"model": "m", "messages": []}),  # no messages
        (Detokenize, {"model": "m", "tokens": "1 2"}),  # not a list
    ],
)
def test_bodies_are_validated(client: TestClient, model: Callable[..., Any], body: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        model(**body)
    route = "/detokenize" if model is Detokenize else "/tokenize"
    assert client.post(route, json=body).status_code == 400
