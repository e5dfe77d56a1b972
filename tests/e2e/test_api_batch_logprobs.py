"""Batched completion prompts and prompt logprobs (echo + logprobs, vLLM's prompt_logprobs) through
the official `openai` client against the real services; HF transformers (fp32) is the oracle.

CPU budget: every request generates at most 6 tokens, and all of them go out at once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import RunningServices

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]
ID_PROMPTS = [[504, 3575, 282, 4649, 314], [19556, 905]]
MESSAGES = [{"role": "user", "content": "Name a colour."}]
N, MAX_TOKENS = 2, 6


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def hf_log_softmax(smollm2_dir: Path) -> Any:
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()

    def prompt_rows(token_ids: list[int]) -> torch.Tensor:  # [len - 1, vocab]: predicts tokens 1..
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([token_ids])).logits[0, :-1].float(), dim=-1)

    return prompt_rows


@pytest.fixture(scope="module")
def answers(services: RunningServices) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with openai.AsyncOpenAI(
            base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=600
        ) as client:
            complete = client.completions.create
            greedy = {"model": services.model, "temperature": 0, "max_tokens": MAX_TOKENS}
            calls: dict[str, Any] = {
                "batch": complete(**greedy, prompt=PROMPTS, n=N, logprobs=1),
                "batch_stream": _joined(
                    complete(**greedy, prompt=PROMPTS, n=N, stream=True, stream_options={"include_usage": True})
                ),
                "batch_ids": complete(**greedy, prompt=ID_PROMPTS),
                "echo_logprobs": complete(**greedy, prompt=PROMPTS[0], echo=True, logprobs=3),
                "echo_logprobs_stream": _joined(
                    complete(**greedy, prompt=PROMPTS[0], echo=True, logprobs=3, stream=True)
                ),
                "prompt_logprobs": complete(**greedy, prompt=PROMPTS[1], extra_body={"prompt_logprobs": 2}),
                "chat_prompt_logprobs": client.chat.completions.create(
                    **greedy, messages=MESSAGES, extra_body={"prompt_logprobs": 0}
                ),
            }
            for i, prompt in enumerate(PROMPTS):
                calls[f"single_{i}"] = complete(**greedy, prompt=prompt, n=N, logprobs=1)
            for i, ids in enumerate(ID_PROMPTS):
                calls[f"single_ids_{i}"] = complete(**greedy, prompt=ids)
            results = await asyncio.gather(*calls.values(), return_exceptions=True)
        return dict(zip(calls, results))

    return asyncio.run(go())


async def _joined(call: Any) -> dict[str, Any]:
    """A completion stream joined per choice index: text, logprob lists, finish reasons, usage."""
    texts: dict[int, str] = {}
    logprobs: dict[int, dict[str, list[Any]]] = {}
    finish: dict[int, str] = {}
    usage = None
    async for chunk in await call:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.logprobs:
                joined = logprobs.setdefault(choice.index, {"tokens": [], "token_logprobs": [], "text_offset": []})
                for key in joined:
                    joined[key] += getattr(choice.logprobs, key)
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return {"texts": texts, "logprobs": logprobs, "finish": finish, "usage": usage}


def result(answers: dict[str, Any], name: str) -> Any:
    value = answers[name]
    if isinstance(value, BaseException):
        raise value
    return value


def test_batched_prompts_match_one_by_one(answers: dict[str, Any]) -> None:
    batch = result(answers, "batch")
    singles = [result(answers, f"single_{i}") for i in range(len(PROMPTS))]
    assert sorted(c.index for c in batch.choices) == list(range(len(PROMPTS) * N))
    for choice in batch.choices:
        prompt, sample = divmod(choice.index, N)  # OpenAI's numbering: prompt i, sample j -> i * n + j
        single = singles[prompt].choices[sample]
        assert choice.text == single.text and choice.finish_reason == single.finish_reason
        assert choice.logprobs.tokens == single.logprobs.tokens
        assert choice.logprobs.token_logprobs == pytest.approx(single.logprobs.token_logprobs, abs=1e-4)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(batch.usage, key) == sum(getattr(s.usage, key) for s in singles)
    assert len({c.text for c in batch.choices}) >= 2  # the prompts really differ


def test_batched_prompts_stream_like_one_by_one(answers: dict[str, Any]) -> None:
    streamed = result(answers, "batch_stream")
    batch = result(answers, "batch")
    assert streamed["texts"] == {c.index: c.text for c in batch.choices}
    assert streamed["finish"] == {c.index: c.finish_reason for c in batch.choices}
    assert streamed["usage"].total_tokens == batch.usage.total_tokens


def test_batched_token_id_prompts(answers: dict[str, Any]) -> None:
    batch = result(answers, "batch_ids")
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [
        result(answers, f"single_ids_{i}").choices[0].text for i in range(len(ID_PROMPTS))
    ]
    assert batch.usage.prompt_tokens == sum(len(ids) for ids in ID_PROMPTS)


def test_echo_logprobs_cover_the_prompt_and_match_hf(
    answers: dict[str, Any], tokenizer: Any, hf_log_softmax: Any
) -> None:
    choice = result(answers, "echo_logprobs").choices[0]
    prompt_ids = tokenizer.encode(PROMPTS[0])
    lp = choice.logprobs
    assert choice.text.startswith(PROMPTS[0])
    assert "".join(lp.tokens[: len(prompt_ids)]) == PROMPTS[0]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # no context for the first token
    expected = hf_log_softmax(prompt_ids)
    for position in range(1, len(prompt_ids)):
        row = expected[position - 1]
        assert lp.token_logprobs[position] == pytest.approx(float(row[prompt_ids[position]]), abs=2e-3)
        assert len(lp.top_logprobs[position]) == 3
        assert max(lp.top_logprobs[position].values()) == pytest.approx(float(row.max()), abs=2e-3)
    assert len(lp.tokens) == len(prompt_ids) + MAX_TOKENS  # then the generated tokens
    assert lp.text_offset[len(prompt_ids)] == len(PROMPTS[0])
    streamed = result(answers, "echo_logprobs_stream")
    assert streamed["texts"][0] == choice.text
    assert streamed["logprobs"][0]["tokens"] == lp.tokens
    assert streamed["logprobs"][0]["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert streamed["logprobs"][0]["text_offset"] == lp.text_offset


def test_vllm_prompt_logprobs_match_hf(
    answers: dict[str, Any], tokenizer: Any, hf_log_softmax: Any, services: RunningServices
) -> None:
    chat_ids = httpx.post(f"{services.base_url}/tokenize", json={"model": services.model, "messages": MESSAGES})
    cases = [
        (result(answers, "prompt_logprobs").choices[0].model_extra["prompt_logprobs"], tokenizer.encode(PROMPTS[1]), 2),
        (result(answers, "chat_prompt_logprobs").model_extra["prompt_logprobs"], chat_ids.json()["tokens"], 0),
    ]
    for got, prompt_ids, k in cases:
        expected = hf_log_softmax(prompt_ids)
        assert len(got) == len(prompt_ids) and got[0] is None
        for position in range(1, len(prompt_ids)):
            entry, row, token_id = got[position], expected[position - 1], prompt_ids[position]
            assert entry[str(token_id)]["logprob"] == pytest.approx(float(row[token_id]), abs=2e-3)
            assert entry[str(token_id)]["decoded_token"] == tokenizer.decode([token_id])
            top = {str(t) for t in row.topk(k).indices.tolist()} if k else set()
            assert top <= set(entry) and set(entry) <= top | {str(token_id)}  # the top k, and the token itself


def test_a_refused_prompt_refuses_the_batch_and_frees_the_rest(services: RunningServices) -> None:
    """The accepted prompts of a batch with one over-long prompt are aborted; nothing stays in flight."""
    from tests.e2e.test_reliability import _engine_load, _wait_idle

    idle = _wait_idle(services, _engine_load(services).num_total_blocks, 30)
    body = {
        "model": services.model,
        "prompt": ["Once upon a time", "hi " * 3000],
        "max_tokens": 1000,
        "ignore_eos": True,
    }
    response = httpx.post(f"{services.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    _wait_idle(services, idle.num_free_blocks, timeout_s=10)  # 1000 tokens would take far longer
    metrics = httpx.get(f"{services.base_url}/metrics", timeout=10).text
    assert "pagedserve_requests_in_flight 0.0" in metrics
