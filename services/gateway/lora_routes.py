"""LoRA adapters as models: their cards in /v1/models, and vLLM's routes to load and unload them at run time.

    POST /v1/load_lora_adapter    {"lora_name", "lora_path", "model"?}  -> "Success: LoRA adapter 'x' added ..."
    POST /v1/unload_lora_adapter  {"lora_name", "model"?}               -> "Success: LoRA adapter 'x' removed ..."

Served only with --allow-runtime-lora-updating (vLLM guards them with VLLM_ALLOW_RUNTIME_LORA_UPDATING); else 404.
`model` names the base model, needed only when several served models have LoRA enabled. A load is checked here
when the folder is visible to the gateway (rank, target modules: 400 naming the reason), broadcast to every
engine of the model (LoRAUpdate on its control stream), remembered in ps:{model}:loras for replicas that start
later, and answered once every live engine's heartbeat lists the adapter, or one of them reports why it could
not load it (400, and the others drop it again).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import Field
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.frontend import Frontend
from pagedserve.services.gateway.messages import Strict
from pagedserve.services.gateway.registry import ModelEntry, ModelRegistry
from pagedserve.services.gateway.validation import read_json, validate
from pagedserve.shared import streams
from pagedserve.shared.config import LoRAConfig
from pagedserve.shared.lora_adapters import LoRAAdapterError, inspect_adapter
from pagedserve.shared.protocol import LoRAUpdate

log = logging.getLogger(__name__)
_CONFIRM_TIMEOUT_S = 30.0  # engines apply an update between steps and show it in their next heartbeat
_POLL_S = 0.1


class LoadLoRA(Strict):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    model: str | None = None  # the base model


class UnloadLoRA(Strict):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's; names are what identify an adapter here
    model: str | None = None


def adapter_cards(registry: ModelRegistry) -> list[dict[str, Any]]:
    """vLLM's LoRA model cards: `root` the adapter's folder, `parent` its base model."""
    return [
        adapter_card(name, path, entry)
        for entry in registry.servable_models()
        for name, path in sorted(entry.adapters.items())
    ]


def adapter_card(name: str, path: str, base: ModelEntry) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(base.first_seen),
        "owned_by": "pagedserve",
        "root": path,
        "parent": base.name,
        "max_model_len": base.max_model_len,
    }


def routes(settings: LoRAConfig) -> list[Route]:
    async def load(request: Request) -> Response:
        frontend = _frontend(request, settings)
        req = validate(LoadLoRA, await read_json(request, frontend.settings.max_body_bytes))
        registry = frontend.registry
        await registry.refresh_now()
        base = _base_model(registry, req.model)
        name = req.lora_name
        if name in registry.models or registry.base_of(name) is not None:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if Path(req.lora_path).is_dir():  # else only the engines can see it: they check it
            try:
                await asyncio.to_thread(inspect_adapter, req.lora_path, base.max_lora_rank)
            except LoRAAdapterError as exc:
                raise APIError(400, f"Invalid LoRA adapter: {exc}", param="lora_path") from None
        update = LoRAUpdate(uuid.uuid4().hex, "load", name, req.lora_path)
        await _broadcast(frontend, base.name, update)
        error = await _confirm(registry, base.name, lambda e: name in e.lora_adapters, update.update_id)
        if error is not None:  # undo it everywhere: the replicas that did load it drop it
            await _broadcast(frontend, base.name, LoRAUpdate(uuid.uuid4().hex, "unload", name))
            raise APIError(400, f"Invalid LoRA adapter: {error}", param="lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: Request) -> Response:
        frontend = _frontend(request, settings)
        req = validate(UnloadLoRA, await read_json(request, frontend.settings.max_body_bytes))
        registry = frontend.registry
        await registry.refresh_now()
        name = req.lora_name
        base = registry.base_of(name) if req.model is None else registry.get(req.model)
        if base is None or name not in base.adapters:
            message = f"The lora adapter '{name}' cannot be found."
            raise APIError(404, message, param="lora_name", code="model_not_found")
        update = LoRAUpdate(uuid.uuid4().hex, "unload", name)
        await _broadcast(frontend, base.name, update)
        await _confirm(registry, base.name, lambda e: name not in e.lora_adapters, update.update_id)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return [
        Route("/v1/load_lora_adapter", load, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload, methods=["POST"]),
    ]


async def _broadcast(frontend: Frontend, model: str, update: LoRAUpdate) -> None:
    """Record the update for replicas that start later, and send it to every engine of the model now."""
    try:
        if update.action == "load":
            await frontend.redis.hset(streams.lora_key(model), update.lora_name, update.lora_path)
        else:
            await frontend.redis.hdel(streams.lora_key(model), update.lora_name)
        await frontend.publisher.publish(streams.control_stream(model), update, 10_000)
    except (RedisError, OSError) as exc:
        log.warning("LoRA update of %s not sent: %s", model, exc)  # the detail goes to the log, not the client
        raise APIError(503, "the control stream (Redis) is unavailable; retry shortly", retry_after=2) from None


def _frontend(request: Request, settings: LoRAConfig) -> Frontend:
    if not settings.allow_runtime_lora_updating:
        raise APIError(
            404,
            "Loading and unloading LoRA adapters at run time is off; start the server with "
            "--allow-runtime-lora-updating (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
            code="not_found",
        )
    frontend: Frontend = request.app.state.frontend
    return frontend


def _base_model(registry: ModelRegistry, name: str | None) -> ModelEntry:
    """The model an adapter is loaded onto: the one named, or the only one served with LoRA enabled."""
    if name is not None:
        entry = registry.get(name)
        if entry is None or not entry.is_live:
            raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        if not entry.max_lora_rank:
            raise APIError(400, f"The model '{name}' is not served with --enable-lora", param="model")
        return entry
    candidates = [m for m in registry.live_models() if m.max_lora_rank]
    if len(candidates) != 1:
        why = "no served model has LoRA enabled (--enable-lora)" if not candidates else "several models serve LoRA"
        raise APIError(400, f"{why}; name the base model in `model`", param="model")
    return candidates[0]


async def _confirm(registry: ModelRegistry, model: str, is_done: Any, update_id: str) -> str | None:
    """Wait until every live engine of `model` shows the update done; the reason one gave for failing it, if any."""
    deadline = time.monotonic() + _CONFIRM_TIMEOUT_S
    while time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)
        await registry.refresh_now()
        entry = registry.get(model)
        engines = [e for e in entry.engines if not e.is_draining] if entry is not None else []
        for engine in engines:
            if update_id in engine.lora_errors:
                return engine.lora_errors[update_id]
        if engines and all(is_done(e) for e in engines):
            return None
    raise APIError(503, "not every engine confirmed the LoRA update in time; retry shortly", retry_after=2)
