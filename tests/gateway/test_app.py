"""The gateway's edge without any backend: auth, body limits, JSON and content type, error shapes.

Nothing here reaches Redis (the URL points at a closed port): every answer is decided at the edge.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from pagedserve.services.gateway.app import build_app
from pagedserve.services.gateway.auth import ApiKeyMiddleware
from pagedserve.shared.config import Config
from pagedserve.shared.redis_server import free_port

KEYS = ["key-one", "key-two"]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    config = Config.of(redis_url=f"redis://127.0.0.1:{free_port()}/0", api_keys=KEYS, max_body_bytes=2000)
    with TestClient(build_app(config)) as test_client:
        yield test_client


def auth(key: str = KEYS[1]) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def assert_error(response: Any, status: int, type_: str, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == (type_, param)
    return error


def test_api_keys_guard_every_route_but_health_and_ready(client: TestClient) -> None:
    for headers in ({}, auth("wrong"), {"authorization": "key-one"}, {"authorization": "Bearer "}):
        response = client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert assert_error(response, 401, "invalid_request_error")["code"] == "invalid_api_key"
    for path in ("/v1/models", "/v1/models/m"):
        assert client.get(path).status_code == 401
    for path in ("/tokenize", "/detokenize", "/v1/completions"):
        assert client.post(path, json={}).status_code == 401
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code == 503  # open (not 401), and not ready without Redis
    assert client.get("/v1/models", headers=auth()).status_code == 200
    assert client.get("/v1/models", headers={"authorization": "bearer key-one"}).status_code == 200


def test_key_comparison() -> None:
    middleware = ApiKeyMiddleware(app=None, keys=KEYS)
    assert middleware.is_authorized(b"Bearer key-one") and middleware.is_authorized(b"BEARER key-two")
    assert not middleware.is_authorized(b"Bearer key-on") and not middleware.is_authorized(b"Bearer key-one2")
    assert not middleware.is_authorized(b"key-one") and not middleware.is_authorized(b"")


def test_body_limits_and_encoding(client: TestClient) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 3000}]}
    assert_error(client.post("/v1/chat/completions", json=big, headers=auth()), 413, "invalid_request_error")

    def chunks() -> Iterator[bytes]:  # no content-length: the cap holds while reading
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(30):
            yield b"y" * 100
        yield b'"}]}'

    json_type = {**auth(), "content-type": "application/json"}
    response = client.post("/v1/chat/completions", content=chunks(), headers=json_type)
    assert_error(response, 413, "invalid_request_error")
    response = client.post("/v1/chat/completions", content=b"{}", headers={**auth(), "content-type": "text/plain"})
    assert_error(response, 415, "invalid_request_error")
    for raw in (b"{not json", b'{"model": NaN}', b"\xff\xfe", b"[" * 900 + b"]" * 900):
        response = client.post(
            "/v1/chat/completions", content=raw, headers={**auth(), "content-type": "application/json"}
        )
        assert_error(response, 400, "invalid_request_error")
    response = client.post("/v1/completions", content=b"[1, 2]", headers={**auth(), "content-type": "application/json"})
    assert_error(response, 400, "invalid_request_error")


def test_errors_before_any_backend(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json={**CHAT, "temperature": 9}, headers=auth())
    assert_error(response, 400, "invalid_request_error", "temperature")
    assert response.headers["x-should-retry"] == "false"  # the openai client must not retry a 400
    response = client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=auth())
    assert assert_error(response, 404, "invalid_request_error", "model")["code"] == "model_not_found"
    response = client.post("/tokenize", json={"model": "nope", "prompt": "x"}, headers=auth())
    assert_error(response, 404, "invalid_request_error", "model")
    response = client.post("/detokenize", json={"model": "nope", "tokens": [-1]}, headers=auth())
    assert_error(response, 400, "invalid_request_error", "tokens[0]")
    assert_error(client.get("/v1/nothing-here", headers=auth()), 404, "invalid_request_error")
    response = client.get("/v1/chat/completions", headers=auth())
    assert_error(response, 405, "invalid_request_error")
    assert "POST" in response.headers["allow"]
    assert_error(client.get("/v1/models/nope", headers=auth()), 404, "invalid_request_error", "model")


def test_unknown_fields_pass_validation_unless_strict(client: TestClient) -> None:
    """Lenient (the default) drops them and goes on (to a 404 here: no engine serves "m"); strict mode
    answers 400 naming the field, as OpenAI does."""
    unknown = {**CHAT, "frobnicate": 1, "messages": [{"role": "user", "content": "hi", "x": 1}]}
    for route, body in (("/v1/chat/completions", unknown), ("/v1/completions", {"model": "m", "prompt": "p", "y": 2})):
        assert_error(client.post(route, json=body, headers=auth()), 404, "invalid_request_error", "model")
    response = client.post("/v1/chat/completions", json={**unknown, "store": "yes"}, headers=auth())
    assert_error(response, 400, "invalid_request_error", "store")  # a wrong type is still refused

    strict = Config.of(redis_url=f"redis://127.0.0.1:{free_port()}/0", strict_request_fields=True)
    with TestClient(build_app(strict)) as strict_client:
        for route, body, param in (
            ("/v1/chat/completions", {**CHAT, "frobnicate": 1}, "frobnicate"),
            ("/v1/chat/completions", unknown, "messages[0].x"),
            ("/v1/completions", {"model": "m", "prompt": "p", "y": 2}, "y"),
        ):
            error = assert_error(strict_client.post(route, json=body), 400, "invalid_request_error", param)
            assert error["code"] == "unknown_parameter" and param in error["message"]
        store = {**CHAT, "store": True, "metadata": {"a": "b"}}  # known fields are not unknown in strict mode
        assert_error(strict_client.post("/v1/chat/completions", json=store), 404, "invalid_request_error", "model")


def test_ready_names_the_models_only_to_a_caller_with_a_key(client: TestClient) -> None:
    anonymous = client.get("/ready")
    assert anonymous.status_code == 503 and "models" not in anonymous.json()  # a probe still reads ready/redis
    assert set(anonymous.json()) == {"ready", "redis"}
    assert client.get("/ready", headers=auth("wrong")).json().keys() == {"ready", "redis"}
    assert client.get("/ready", headers=auth()).json()["models"] == []
