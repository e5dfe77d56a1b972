"""`/tokenize` and `/detokenize`: the same ids the tokenizer service gives a request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
from transformers import AutoTokenizer

from tests.conftest import E2E_MAX_MODEL_LEN, RunningServices

MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]


def post(services: RunningServices, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{services.base_url}{path}", json={"model": services.model, **body}, timeout=60)


def test_tokenize_and_detokenize(services: RunningServices, smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = "Héllo wörld, 😀!"
    plain = post(services, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    expected = tokenizer.encode(text)
    assert plain == {
        "count": len(expected),
        "max_model_len": E2E_MAX_MODEL_LEN,
        "tokens": expected,
        "token_strs": tokenizer.convert_ids_to_tokens(expected),
    }
    assert post(services, "/detokenize", {"tokens": expected}).json() == {"prompt": text}

    chat = post(services, "/tokenize", {"messages": MESSAGES}).json()
    template = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat["tokens"] == list(template) and chat["count"] == len(template)
    bare = post(services, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"] and chat["tokens"][: bare["count"]] == bare["tokens"]

    # A chat request's prompt is exactly what /tokenize says.
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=services.model, messages=MESSAGES, max_tokens=1)
    assert reply.usage.prompt_tokens == chat["count"]

    for path, body, param in [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "nobody", "content": "x"}]}, "messages[0].role"),
        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"prompt": "x", "model": "no-such-model"}, "model"),
    ]:
        response = post(services, path, body)
        assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, (path, body)
