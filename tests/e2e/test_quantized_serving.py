"""4-bit checkpoints served end to end (issue 21): a tiny Llama with SmolLM2's tokenizer, its decoder linears
packed as GPTQ (act order, asymmetric) and as AWQ, each served by its own tokenizer and engine behind the shared
gateway. Greedy output through the OpenAI client equals HF's on the weights the checkpoint means, in fp32."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.conftest import RunningServices, start_service, stop_all
from tests.e2e.tiny_llama import build_tiny_llama
from tests.models.int4_checkpoints import QUANTIZED_LINEARS, awq_tensors, gptq_tensors, in_hf_layout
from tests.models.tiny_models import hf_greedy

Pack = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]  # W [K, N] -> (tensors, meaning)
FORMATS: dict[str, tuple[Pack, dict[str, object]]] = {
    "tiny-gptq": (
        lambda w: gptq_tensors(w, 32, act_order=True),
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False},
    ),
    "tiny-awq": (
        lambda w: awq_tensors(w, 32),
        {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True},
    ),
}
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356]
NEW_TOKENS = 32
# HF's init (std 0.02) leaves the tiny decoder's linears almost silent: greedy would repeat one token whatever
# they held. Ten times larger, the 32 tokens are ~30 distinct ones, and differ from the unquantized weights'.
WEIGHT_SCALE = 10.0


def write_4bit(model_dir: Path, pack: Pack, quantization_config: dict[str, object]) -> PreTrainedModel:
    """Rewrite the tiny Llama's decoder linears in place; return HF's model on the weights they mean (the oracle)."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    written: dict[str, torch.Tensor] = {}
    meant: dict[str, torch.Tensor] = {}
    for name, weight in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED_LINEARS:
            packed, meant[name] = in_hf_layout(pack)(WEIGHT_SCALE * weight.float())
            written.update({f"{name.removesuffix('.weight')}.{key}": value for key, value in packed.items()})
        else:
            written[name] = meant[name] = weight
    save_file(written, str(path))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    oracle = AutoModelForCausalLM.from_pretrained(model_dir.parent / "source", dtype=torch.float32).eval()
    oracle.load_state_dict(meant, strict=False)  # tied: the checkpoint holds the embedding once
    return oracle


@pytest.fixture(scope="module")
def quantized_models(
    services: RunningServices, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, PreTrainedModel]]:
    root = tmp_path_factory.mktemp("quantized")
    build_tiny_llama(root / "source", smollm2_dir)
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": services.redis_url}
    oracles: dict[str, PreTrainedModel] = {}
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, (pack, config) in FORMATS.items():
            model_dir = root / name
            subprocess.run(["cp", "-r", str(root / "source"), str(model_dir)], check=True)
            oracles[name] = write_4bit(model_dir, pack, config)
            common = ["--model", str(model_dir), "--served-model-name", name]
            engine = ["engine", *common, "--device", "cpu", "--dtype", "float32", "--cpu-threads", "1"]
            processes[f"{name}-tokenizer"] = start_service(
                f"{name}-tokenizer", ["tokenizer", *common], env, services.log_dir
            )
            processes[f"{name}-engine"] = start_service(f"{name}-engine", engine, env, services.log_dir)
        deadline = time.monotonic() + 120
        while not set(FORMATS) <= _model_ids(services):
            dead = [n for n, p in processes.items() if p.poll() is not None]
            assert not dead, f"{dead} died (logs in {services.log_dir})"
            assert time.monotonic() < deadline, "the quantized models were not listed after 120 s"
            time.sleep(0.25)
        yield oracles
    finally:
        stop_all(processes)


def _model_ids(services: RunningServices) -> set[str]:
    return {m["id"] for m in httpx.get(f"{services.base_url}/v1/models").json()["data"]}


@pytest.mark.parametrize("name", list(FORMATS))
def test_served_greedy_equals_hf_on_the_meant_weights(
    name: str, services: RunningServices, quantized_models: dict[str, PreTrainedModel]
) -> None:
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0)
    answer = client.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    got = (answer.choices[0].model_extra or {}).get("token_ids")
    want = hf_greedy(quantized_models[name], PROMPT, NEW_TOKENS)
    assert len(set(want)) > NEW_TOKENS // 2, "a degenerate continuation would not show the weights"
    assert got == want
    assert answer.usage is not None and answer.usage.completion_tokens == NEW_TOKENS
