"""LoRA adapters through the running services (the shared stack: SmolLM2, --enable-lora, runtime updates on):
loaded at run time, listed with their parent, served under their own name, unloaded; unknown adapters get 404
and adapters beyond the settings 400, in OpenAI's error shape. (That an adapter's output equals PEFT's merged
weights is checked on the engine itself: tests/engine/test_lora.py.)"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagedserve.shared import streams
from pagedserve.shared.protocol import EngineHeartbeat, decode_as
from tests.conftest import E2E_MAX_MODEL_LEN, RunningServices, start_service, stop_all
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


def _adapters_by_engine(redis_url: str, model: str) -> dict[str, dict[str, str]]:
    """Each live engine of `model`: the adapters its heartbeat says it serves."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=streams.engine_key(streams.glob_escape(model), "*")))
        beats = [decode_as(raw, EngineHeartbeat) for raw in client.mget(keys) if raw] if keys else []
    finally:
        client.close()
    return {beat.engine_id: beat.lora_adapters for beat in beats if not beat.is_draining}


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_later_replica_loads_runtime_adapters_and_unloads_reach_every_replica(
    services: RunningServices, http: httpx.Client, adapter_dirs: dict[str, Path]
) -> None:
    path = str(adapter_dirs["ok"])
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "smol-late", "lora_path": path}).status_code == 200
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": services.redis_url}
    engine_args = ["--device", "cpu", "--dtype", "float32", "--cpu-threads", "1", "--enable-lora", "--max-loras", "2"]
    second = start_service(
        "lora-engine-2",
        ["engine", *engine_args, "--max-model-len", str(E2E_MAX_MODEL_LEN), "--engine-id", "lora-engine-2"],
        env,
        services.log_dir,
    )
    try:
        # it started after the load: it finds the adapter in Redis and loads it too
        _wait_for(
            lambda: _adapters_by_engine(services.redis_url, services.model).get("lora-engine-2") == {"smol-late": path},
            120,
            "the second replica never served the adapter loaded before it started",
        )
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "smol-late"})
        assert unloaded.status_code == 200, unloaded.text
        served = _adapters_by_engine(services.redis_url, services.model)
        assert len(served) == 2 and all(adapters == {} for adapters in served.values())  # both dropped it
    finally:
        http.post("/v1/unload_lora_adapter", json={"lora_name": "smol-late"})  # 404 once done: harmless
        stop_all({"lora-engine-2": second})
