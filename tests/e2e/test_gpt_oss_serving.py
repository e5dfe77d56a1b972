"""A tiny random gpt-oss served behind the shared gateway (its own tokenizer and engine, CPU fp32):
greedy tokens and prompt logprobs through the OpenAI API equal HF transformers' on a prompt 3x its window."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, GptOssConfig, PreTrainedModel

from tests.conftest import RunningServices, start_service, stop_all
from tests.e2e.tiny_llama import copy_tokenizer

MODEL = "tiny-gpt-oss"
NUM_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tiny_gpt_oss(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    config = GptOssConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,  # local, global
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=8.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=64,
        ),
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out = tmp_path_factory.mktemp("models") / MODEL
    model.save_pretrained(out)
    return copy_tokenizer(smollm2_dir, out), model


@pytest.fixture(scope="module")
def served(services: RunningServices, tiny_gpt_oss: tuple[Path, PreTrainedModel]) -> Iterator[None]:
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": services.redis_url}
    common = ["--model", str(tiny_gpt_oss[0]), "--served-model-name", MODEL]
    processes = {
        "gpt-oss-tokenizer": start_service("gpt-oss-tokenizer", ["tokenizer", *common], env, services.log_dir),
        "gpt-oss-engine": start_service(
            "gpt-oss-engine", ["engine", *common, "--device", "cpu", "--cpu-threads", "1"], env, services.log_dir
        ),
    }
    deadline = time.monotonic() + 120
    while MODEL not in [m["id"] for m in httpx.get(f"{services.base_url}/v1/models").json()["data"]]:
        assert time.monotonic() < deadline, "the gpt-oss model never appeared in /v1/models"
        assert all(p.poll() is None for p in processes.values()), "the gpt-oss services died"
        time.sleep(0.25)
    yield
    stop_all(processes)


@pytest.mark.usefixtures("served")
def test_greedy_and_prompt_logprobs_match_hf(
    services: RunningServices, tiny_gpt_oss: tuple[Path, PreTrainedModel]
) -> None:
    _, hf = tiny_gpt_oss
    prompt = torch.randint(3, 49152, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0)
    answer = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=NUM_NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, "prompt_logprobs": 0},
    )
    got = answer.choices[0].model_dump()  # vLLM's extras (token_ids, prompt_logprobs) ride along
    tokens = got["token_ids"]
    assert len(tokens) == NUM_NEW_TOKENS
    # One HF forward over prompt + answer: greedy means each answer token is HF's argmax after what precedes it.
    with torch.inference_mode():
        logits = hf(torch.tensor([[*prompt, *tokens]])).logits[0]
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == tokens
    assert len(set(tokens)) > 4  # not a degenerate repeat-one-token answer
    expected = torch.log_softmax(logits[: len(prompt) - 1], dim=-1)
    prompt_logprobs = got["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = prompt_logprobs[position][str(prompt[position])]
        assert entry["logprob"] == pytest.approx(float(expected[position - 1, prompt[position]]), abs=1e-4)
