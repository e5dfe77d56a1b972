"""/v1/embeddings end to end: a tiny random Llama saved as a sentence-transformers checkpoint (last-token
pooling, normalized, Matryoshka in its config) is served beside the shared chat model, by its own tokenizer
and an engine that detects the pooling runner from the checkpoint. HF transformers' final hidden states,
pooled the same way, are the oracle; the openai client sends every input shape and decodes base64."""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from tests.conftest import RunningServices, start_service, stop_all
from tests.e2e.tiny_llama import build_tiny_llama

EMBED = "tiny-embed"
TEXTS = ["The capital of France is Paris.", "Redis streams carry every request."]


@pytest.fixture(scope="module")
def embed_model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_tiny_llama(tmp_path_factory.mktemp("models") / EMBED, smollm2_dir)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    return path


@pytest.fixture(scope="module")
def embed_server(services: RunningServices, embed_model_dir: Path) -> Iterator[RunningServices]:
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": services.redis_url}
    common = ["--model", str(embed_model_dir), "--served-model-name", EMBED]
    processes = {
        "embed-tokenizer": start_service("embed-tokenizer", ["tokenizer", *common], env, services.log_dir),
        "embed-engine": start_service(
            "embed-engine", ["engine", *common, "--device", "cpu", "--cpu-threads", "1"], env, services.log_dir
        ),
    }
    deadline = time.monotonic() + 120
    while EMBED not in [m["id"] for m in httpx.get(f"{services.base_url}/v1/models").json()["data"]]:
        assert time.monotonic() < deadline and all(p.poll() is None for p in processes.values()), "not served"
        time.sleep(0.25)
    yield services
    stop_all(processes)


def _expected(model_dir: Path, token_ids: list[int], dimensions: int | None = None) -> torch.Tensor:
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        last = hf(torch.tensor([token_ids])).last_hidden_state[0, -1]
    last = last[:dimensions] if dimensions else last
    return last / last.norm()


def _client(services: RunningServices) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0)


def test_embeddings_match_hf_in_every_input_shape(embed_server: RunningServices, embed_model_dir: Path) -> None:
    client = _client(embed_server)
    tokenizer = AutoTokenizer.from_pretrained(embed_model_dir)
    token_ids = [tokenizer.encode(text) for text in TEXTS]
    expected = [_expected(embed_model_dir, ids) for ids in token_ids]

    floats = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1] and floats.model == EMBED
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(len(ids) for ids in token_ids)
    for data, want in zip(floats.data, expected):
        got = torch.tensor(data.embedding)
        assert got.shape == (64,)
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.9999
        assert torch.allclose(got, want, atol=1e-4)

    # token-id lists; with no encoding_format the client asks for base64 and decodes it itself
    decoded = client.embeddings.create(model=EMBED, input=token_ids)
    as_floats = torch.tensor([d.embedding for d in floats.data])
    assert torch.allclose(torch.tensor([d.embedding for d in decoded.data]), as_floats, atol=1e-6)
    encoded = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="base64")  # left encoded
    raw = [np.frombuffer(base64.b64decode(str(d.embedding)), dtype="<f4") for d in encoded.data]
    assert torch.allclose(torch.tensor(np.stack(raw)), as_floats, atol=1e-6)
    one = client.embeddings.create(model=EMBED, input=token_ids[1], user="u-1")
    assert len(one.data) == 1 and torch.allclose(torch.tensor(one.data[0].embedding), as_floats[1], atol=1e-6)

    small = client.embeddings.create(model=EMBED, input=TEXTS[0], dimensions=16)
    got = torch.tensor(small.data[0].embedding)
    assert got.shape == (16,) and torch.allclose(got, _expected(embed_model_dir, token_ids[0], 16), atol=1e-4)


def test_embedding_errors_name_the_parameter(embed_server: RunningServices) -> None:
    client = _client(embed_server)
    cases = [
        (dict(model=embed_server.model, input="hi"), "model"),  # the shared chat model generates text
        (dict(model=EMBED, input="hi", dimensions=65), "dimensions"),  # hidden size 64
        (dict(model=EMBED, input=[[5] * 2048]), "input"),  # the whole context of 2,048: too long
        (dict(model=EMBED, input=[]), "input"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(**kwargs)
        assert err.value.response.json()["error"]["param"] == param, kwargs
    with pytest.raises(openai.BadRequestError) as err:  # and the reverse: no chat on an embedding model
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}])
    assert err.value.response.json()["error"]["param"] == "model"
    # vLLM's truncate_prompt_tokens keeps the last tokens of an input too long for the context
    cut = client.embeddings.create(model=EMBED, input=[[5] * 3000], extra_body={"truncate_prompt_tokens": 8})
    assert cut.usage.prompt_tokens == 8 and len(cut.data[0].embedding) == 64
