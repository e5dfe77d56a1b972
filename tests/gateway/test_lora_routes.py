"""LoRA adapters at the gateway's edge: their model cards (parent and root), which model serves an adapter, and
the runtime routes' guard (off unless --allow-runtime-lora-updating), all without a backend."""

from __future__ import annotations

from starlette.testclient import TestClient

from pagedserve.services.gateway.app import build_app
from pagedserve.services.gateway.lora_routes import adapter_cards
from pagedserve.services.gateway.registry import ModelEntry, ModelRegistry
from pagedserve.shared.config import Config
from pagedserve.shared.protocol import EngineHeartbeat, TokenizerHeartbeat
from pagedserve.shared.redis_server import free_port


def _registry() -> ModelRegistry:
    registry = ModelRegistry(redis=None, refresh_s=1.0)
    one = EngineHeartbeat("e1", "base", 2048, max_lora_rank=16, lora_adapters={"sql": "/a/sql"})
    two = EngineHeartbeat("e2", "base", 1024, max_lora_rank=8, lora_adapters={"sql": "/a/sql", "chat": "/a/chat"})
    gone = EngineHeartbeat("e3", "base", 4096, is_draining=True, lora_adapters={"old": "/a/old"})
    registry.models["base"] = ModelEntry("base", [one, two, gone], [TokenizerHeartbeat("t", "base")], first_seen=5.0)
    registry.models["other"] = ModelEntry("other", [EngineHeartbeat("e4", "other", 512)])
    return registry


def test_adapters_are_cards_with_their_parent() -> None:
    registry = _registry()
    entry = registry.models["base"]
    assert entry.adapters == {"sql": "/a/sql", "chat": "/a/chat"}  # a draining replica's are not served
    assert entry.max_lora_rank == 8 and registry.models["other"].max_lora_rank == 0
    assert registry.base_of("chat") is entry and registry.base_of("old") is None
    cards = adapter_cards(registry)
    assert [(c["id"], c["parent"], c["root"], c["max_model_len"]) for c in cards] == [
        ("chat", "base", "/a/chat", 1024),
        ("sql", "base", "/a/sql", 1024),
    ]


def test_runtime_routes_are_off_unless_allowed() -> None:
    config = Config.of(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    with TestClient(build_app(config)) as client:
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            response = client.post(route, json={"lora_name": "x", "lora_path": "/x"})
            assert response.status_code == 404
            assert "--allow-runtime-lora-updating" in response.json()["error"]["message"]
