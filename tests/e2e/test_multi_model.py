"""Two models behind one gateway: each answered by its own engine, and a model whose engine dies
drops out of /v1/models within seconds (503 for it, the other model unaffected)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import RunningServices, start_service, stop_all
from tests.e2e.tiny_llama import build_tiny_llama

TINY = "tiny-llama"


@pytest.fixture(scope="module")
def tiny_model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / TINY, smollm2_dir)


@pytest.fixture(scope="module")
def second_model(services: RunningServices, tiny_model_dir: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": services.redis_url}
    common = ["--model", str(tiny_model_dir), "--served-model-name", TINY]
    processes = {
        "tiny-tokenizer": start_service("tiny-tokenizer", ["tokenizer", *common], env, services.log_dir),
        "tiny-engine": start_service(
            "tiny-engine",
            ["engine", *common, "--device", "cpu", "--cpu-threads", "1", "--heartbeat-ttl-s", "3"],
            env,
            services.log_dir,
        ),
    }
    deadline = time.monotonic() + 120
    while TINY not in _model_ids(services) and time.monotonic() < deadline:
        assert all(p.poll() is None for p in processes.values()), "the second model's services died"
        time.sleep(0.25)
    yield processes
    stop_all(processes)


def _model_ids(services: RunningServices) -> list[str]:
    return sorted(m["id"] for m in httpx.get(f"{services.base_url}/v1/models").json()["data"])


def test_two_models_answer_concurrently_each_by_its_own_engine(
    services: RunningServices, second_model: dict[str, subprocess.Popen[bytes]], tiny_model_dir: Path
) -> None:
    assert _model_ids(services) == sorted([services.model, TINY])
    prompt_ids = [1, 9690, 198, 2683, 359, 253, 5356]

    async def go() -> list[openai.types.Completion]:
        async with openai.AsyncOpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(
                *(
                    client.completions.create(
                        model=m, prompt=prompt_ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
                    )
                    for m in (services.model, TINY)
                )
            )

    big, tiny = asyncio.run(go())
    assert (big.model, tiny.model) == (services.model, TINY)
    # The tiny model's answer must be the tiny model's own greedy continuation (HF as the oracle).
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    expected_ids = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False)[0, len(prompt_ids) :]
    assert tiny.usage is not None and tiny.usage.completion_tokens == 8
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tiny.choices[0].text == tokenizer.decode(expected_ids, skip_special_tokens=True)
    assert big.choices[0].text != tiny.choices[0].text


def test_a_model_whose_engine_dies_drops_out_and_answers_503(
    services: RunningServices, second_model: dict[str, subprocess.Popen[bytes]]
) -> None:
    second_model["tiny-engine"].send_signal(signal.SIGKILL)  # no clean deregistration: the TTL must do it
    second_model["tiny-engine"].wait()
    started = time.monotonic()
    while TINY in _model_ids(services):
        assert time.monotonic() - started < 10, "the dead engine's model is still listed"
        time.sleep(0.2)
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 503
    assert err.value.response.headers.get("retry-after")
    ok = client.chat.completions.create(
        model=services.model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=12,
    )
    assert "Paris" in (ok.choices[0].message.content or "")
