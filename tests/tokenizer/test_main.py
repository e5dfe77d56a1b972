"""`pagedserve tokenizer` (tokenizer/main.py): the service it builds from the configuration, its metrics
endpoint, and a SIGTERM or SIGINT ending it. The service runs for real against a closed Redis port (it
retries quietly) until the signal arrives; the ops HTTP server is recorded, not started."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedserve.services.tokenizer import main as tokenizer_main
from pagedserve.services.tokenizer.metrics import TokenizerMetrics
from pagedserve.services.tokenizer.service import TokenizerService
from pagedserve.shared.config import Config
from pagedserve.shared.redis_server import free_port


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's config and tokenizer (no weights: the tokenizer service loads none), with a generation
    config of two EOS ids and a max_new_tokens default."""
    folder = tmp_path_factory.mktemp("tokenizer-model")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "max_new_tokens": 77}))
    return folder


@pytest.fixture()
def harmless_signals() -> Iterator[None]:
    """Should main fail to take SIGTERM/SIGINT over, the test's signal must not end (or interrupt) pytest."""
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


class Started:
    """Records what main starts: the services (each signalled once it runs) and the ops servers."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, sig: signal.Signals) -> None:
        self.services: list[TokenizerService] = []
        self.ops: list[tuple[Any, ...]] = []
        started = self

        class SignalledService(TokenizerService):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                started.services.append(self)

            async def run(self) -> None:
                asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), sig)
                await asyncio.wait_for(super().run(), 10)  # only the signal ends it

        monkeypatch.setattr(tokenizer_main, "TokenizerService", SignalledService)
        monkeypatch.setattr(tokenizer_main, "serve_ops", lambda *args: self.ops.append(args))


def config(model_dir: Path, **flat: Any) -> Config:
    return Config.of(redis_url=f"redis://127.0.0.1:{free_port()}/0", model=str(model_dir), **flat)


@pytest.mark.usefixtures("harmless_signals")
def test_builds_the_service_from_the_model_folder_and_stops_on_sigterm(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = Started(monkeypatch, signal.SIGTERM)
    tokenizer_main.main(config(model_dir, max_model_len=1024))
    (service,) = started.services
    assert service.model == model_dir.name  # the folder's name is the served name by default
    assert service.settings.consumer_name.startswith("tok-")  # a fresh id when none is configured
    limits = service.processor.limits
    assert (limits.max_model_len, limits.eos_token_ids, limits.vocab_size) == (1024, [2, 7], 49152)
    assert service.processor.default_max_tokens == 77  # generation_config.json's max_new_tokens
    assert service.processor.tokenizer.name_or_path == str(model_dir)  # the configured folder's tokenizer
    assert service.metrics is None and started.ops == []  # no metrics port: no ops server
    assert not service.is_ready()


@pytest.mark.usefixtures("harmless_signals")
def test_a_metrics_port_serves_the_metrics_of_the_served_name_and_sigint_stops(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = Started(monkeypatch, signal.SIGINT)
    port = free_port()
    settings = dict(
        served_model_name="alias",
        consumer_name="tok-fixed",
        generation_config="vllm",
        tokenizer_metrics_port=port,
        tokenizer_metrics_host="0.0.0.0",
    )
    tokenizer_main.main(config(model_dir, **settings))
    (service,) = started.services
    assert service.model == "alias" and service.settings.consumer_name == "tok-fixed"
    assert service.processor.limits.max_model_len == 8192  # the model's own context
    assert service.processor.default_max_tokens is None  # --generation-config vllm: no checkpoint defaults
    assert isinstance(service.metrics, TokenizerMetrics) and service.metrics.model == "alias"
    assert started.ops == [(port, service.metrics.registry, service.is_ready, "0.0.0.0")]
