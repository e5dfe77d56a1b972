"""--reasoning-parser on a served chat: a second gateway with the parser, over the shared services. The answer
is forced (a regex grammar, applied from the first token by --grammar-in-reasoning) into
`<think>...</think>answer`, so SmolLM2 writes a reasoning model's shape."""

from __future__ import annotations

import os
from collections.abc import Iterator

import openai
import pytest

from pagedserve.shared.redis_server import free_port
from tests.conftest import RunningServices, start_service, stop_all, wait_ready

SHAPE = {"structured_outputs": {"regex": r"<think>[a-z ]{3,20}</think>[A-Z][a-z]{2,12}"}}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reasoning_gateway(services: RunningServices) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": services.redis_url}
    processes = {
        "qwen3-gateway": start_service(
            "qwen3-gateway",
            [
                "gateway",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--reasoning-parser",
                "qwen3",
                "--grammar-in-reasoning",  # the regex forces the think block itself
            ],
            env,
            services.log_dir,
        )
    }
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, processes)
        yield base_url
    finally:
        stop_all(processes)


def test_reasoning_goes_to_reasoning_content(services: RunningServices, reasoning_gateway: str) -> None:
    plain = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300)
    parsed = openai.OpenAI(base_url=f"{reasoning_gateway}/v1", api_key="x", max_retries=0, timeout=300)
    kwargs = {"model": services.model, "messages": MESSAGES, "temperature": 0, "max_tokens": 40, "extra_body": SHAPE}
    raw = plain.chat.completions.create(**kwargs).choices[0].message.content
    assert raw is not None and raw.startswith("<think>") and "</think>" in raw
    thought, answer = raw.removeprefix("<think>").split("</think>")

    completion = parsed.chat.completions.create(**kwargs)
    message = completion.choices[0].message
    assert message.content == answer
    # the tokens up to the one that completes </think> (each tag is 3 SmolLM2 tokens, the thought 1+): not the answer
    details = completion.usage.completion_tokens_details if completion.usage else None
    assert details is not None and details.reasoning_tokens is not None and completion.usage is not None
    assert 7 <= details.reasoning_tokens < completion.usage.completion_tokens
    assert message.model_extra is not None and message.model_extra["reasoning_content"] == thought

    reasoning, content, usage = "", "", None
    for chunk in parsed.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if not chunk.choices:
            usage = chunk.usage
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == (thought, answer)  # no tag byte in either
    assert usage is not None and usage.completion_tokens_details == details
