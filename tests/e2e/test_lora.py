"""LoRA adapters through the running services (the shared stack: SmolLM2, --enable-lora, runtime updates on):
loaded at run time, listed with their parent, served under their own name, unloaded; unknown adapters get 404
and adapters beyond the settings 400, in OpenAI's error shape. (That an adapter's output equals PEFT's merged
weights is checked on the engine itself: tests/engine/test_lora.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import RunningServices
from tests.lora_helpers import build_adapter

PROMPT_IDS = [1, 504, 3458, 282, 4649, 314]  # SmolLM2 ids: "<|im_start|>The capital of France is"
NUM_TOKENS = 5


@pytest.fixture(scope="module")
def adapter_dirs(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smol-adapters")
    return {
        "ok": build_adapter(smollm2_dir, root / "ok", rank=8, seed=7, target_modules=["q_proj", "v_proj", "down_proj"]),
        "too-big": _rank_only_adapter(root / "big", rank=32),
    }


def _rank_only_adapter(folder: Path, rank: int) -> Path:
    """An adapter the gateway refuses from its config alone (its rank): no weights needed."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank}))
    return folder


@pytest.fixture()
def http(services: RunningServices) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=services.base_url, timeout=60) as client:
        yield client


def _greedy(client: openai.OpenAI, model: str) -> tuple[list[int], str]:
    out = client.completions.create(
        model=model, prompt=PROMPT_IDS, max_tokens=NUM_TOKENS, temperature=0, extra_body={"return_token_ids": True}
    )
    return list(out.choices[0].token_ids), out.model  # type: ignore[attr-defined]


def test_load_serve_list_and_unload(
    services: RunningServices, http: httpx.Client, adapter_dirs: dict[str, Path]
) -> None:
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0)
    path = str(adapter_dirs["ok"])
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "smol-ok", "lora_path": path})
    assert loaded.status_code == 200, loaded.text
    try:
        cards = {m.id: m for m in client.models.list().data}
        card = cards["smol-ok"].model_dump()
        assert card["parent"] == services.model and card["root"] == path

        adapter_tokens, served_as = _greedy(client, "smol-ok")
        base_tokens, _ = _greedy(client, services.model)
        assert adapter_tokens != base_tokens and served_as == "smol-ok"  # the adapter ran, under its own name
        tokenized = http.post("/tokenize", json={"model": "smol-ok", "prompt": "Paris"})
        assert tokenized.status_code == 200 and tokenized.json()["tokens"]  # the base model's tokenizer

        again = http.post("/v1/load_lora_adapter", json={"lora_name": "smol-ok", "lora_path": path})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    finally:
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "smol-ok"})
    assert unloaded.status_code == 200, unloaded.text
    assert "smol-ok" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError) as err:
        _greedy(client, "smol-ok")
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "smol-ok"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_adapters_beyond_the_settings_get_400(
    http: httpx.Client, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    big = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(adapter_dirs["too-big"])})
    assert big.status_code == 400
    assert big.json()["error"]["param"] == "lora_path"
    assert "rank 32 exceeds --max-lora-rank 16" in big.json()["error"]["message"]
    # a folder only the engines could read (not this gateway): their own check answers, through the heartbeat
    missing = http.post("/v1/load_lora_adapter", json={"lora_name": "nowhere", "lora_path": str(tmp_path / "nope")})
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400  # no lora_path
    models = http.get("/v1/models").json()["data"]
    assert {m["id"] for m in models}.isdisjoint({"big", "nowhere"})
