"""The engine fills sampling fields a request left out from --generation-config's generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.service import EngineService
from pagedserve.shared.config import Config
from pagedserve.shared.protocol import GenerateRequest, Sampling


def added_params(engine: Engine, setting: str, sampling: Sampling) -> SamplingParams:
    service = EngineService(Config.of(engine_id="eng-test", generation_config=setting), "m", engine, None)
    seen: list[SamplingParams] = []
    engine.add_request = lambda rid, prompt, params, *rest, **named: seen.append(params)  # type: ignore[method-assign]
    service._add(b"1-0", GenerateRequest("r", "gw", "m", [5, 6, 7], {"max_tokens": 4, **sampling}))
    assert len(seen) == 1, service.active
    return seen[0]


def test_engine_fills_omitted_sampling_fields(tiny_model: CausalLM, tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = Engine(Config.of(model=str(tiny_model_dir), num_kv_blocks=64, block_size=4), model=tiny_model)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 7, "top_p": 0.8}))
    params = added_params(engine, str(tmp_path), {"top_p": 0.5})
    assert (params.temperature, params.top_k, params.top_p) == (0.3, 7, 0.5)  # top_p: the request's
    off = added_params(engine, "vllm", {})
    assert (off.temperature, off.top_k, off.top_p) == (1.0, 0, 1.0)
