"""Beam search (vLLM's use_beam_search) through the whole stack equals a plain-PyTorch beam search on the
Hugging Face model: the same beams, best first, with the same cumulative logprobs; and vLLM's chat `echo`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import RunningServices

PROMPT = "The capital of France is"
WIDTH, MAX_TOKENS = 2, 6


def reference_beam_search(
    model: Any, prompt: list[int], width: int, max_tokens: int, eos_id: int, length_penalty: float
) -> list[tuple[list[int], float, float]]:
    """(output ids, cumulative logprob, score) of the `width` best beams: each step every live beam offers its
    2 * width most likely next tokens, the `width` best non-EOS extensions live on, EOS ones are finished;
    score = cumulative logprob / (prompt + output, less a final EOS) ** length_penalty."""

    def score(tokens: list[int], cum: float) -> float:
        return cum / (len(tokens) - (tokens[-1] == eos_id)) ** length_penalty

    live: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    done: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        grown: list[tuple[list[int], float]] = []
        for tokens, cum in live:
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)
            top = torch.topk(logprobs, 2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                (done if token == eos_id else grown).append(([*tokens, token], cum + logprob))
        live = sorted(grown, key=lambda b: score(*b), reverse=True)[:width]
    best = sorted([*done, *live], key=lambda b: score(*b), reverse=True)[:width]
    return [(tokens[len(prompt) :], cum, score(tokens, cum)) for tokens, cum in best]


@pytest.fixture(scope="module")
def hf(smollm2_dir: Path) -> tuple[Any, Any]:
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def client(services: RunningServices) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300)


def _scored(choice: Any, num_prompt: int, eos_id: int, length_penalty: float) -> tuple[float, float]:
    """(cumulative logprob, score) of a returned beam, from its token logprobs (the final EOS's included)."""
    cum = sum(choice.logprobs.token_logprobs)
    ids = choice.token_ids  # vLLM's return_token_ids
    return cum, cum / (num_prompt + len(ids) - (ids[-1] == eos_id)) ** length_penalty


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_completion_beams_equal_a_pytorch_beam_search(
    client: openai.OpenAI, services: RunningServices, hf: tuple[Any, Any], length_penalty: float
) -> None:
    model, tokenizer = hf
    reply = client.completions.create(
        model=services.model,
        prompt=PROMPT,
        n=WIDTH,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=0,
        extra_body={"use_beam_search": True, "length_penalty": length_penalty, "return_token_ids": True},
    )
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    expected = reference_beam_search(model, prompt_ids, WIDTH, MAX_TOKENS, tokenizer.eos_token_id, length_penalty)
    assert len(reply.choices) == WIDTH
    got = [
        (c.token_ids, *_scored(c, len(prompt_ids), tokenizer.eos_token_id, length_penalty))  # type: ignore[attr-defined]
        for c in reply.choices
    ]
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in expected]
    for (_, cum, score), (_, ref_cum, ref_score) in zip(got, expected):
        assert cum == pytest.approx(ref_cum, abs=2e-3) and score == pytest.approx(ref_score, abs=2e-3)
    assert got[0][2] >= got[1][2]  # best first
    assert reply.choices[0].text != reply.choices[1].text
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt_ids)


def test_a_batch_gives_each_prompt_its_beams(client: openai.OpenAI, services: RunningServices) -> None:
    """vLLM's own check: two copies of one prompt, n=2 beams each."""
    batch = client.completions.create(
        model=services.model,
        prompt=[PROMPT, PROMPT],
        n=WIDTH,
        max_tokens=5,
        temperature=0,
        extra_body={"use_beam_search": True},
    )
    texts = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]
    assert len(texts) == 4 and texts[0] != texts[1]
    assert texts[0] == texts[2] and texts[1] == texts[3]


def test_chat_beams_stream_as_they_answer(client: openai.OpenAI, services: RunningServices) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    common: dict[str, Any] = dict(model=services.model, messages=messages, n=WIDTH, max_tokens=MAX_TOKENS)
    beam = {"use_beam_search": True, "best_of": 3}
    whole = client.chat.completions.create(**common, extra_body=beam)
    texts = [c.message.content for c in whole.choices]
    assert len(texts) == WIDTH and texts[0] != texts[1]
    streamed = ["", ""]
    finishes: list[str | None] = [None, None]
    for chunk in client.chat.completions.create(**common, stream=True, extra_body=beam):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert streamed == texts
    assert finishes == [c.finish_reason for c in whole.choices]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{**common, "n": 11}, extra_body={"use_beam_search": True})
    assert err.value.body["param"] == "n"  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_starts_the_answer_with_the_continued_message(
    client: openai.OpenAI, services: RunningServices, stream: bool
) -> None:
    start = "The capital of France is"
    messages = [{"role": "user", "content": "Finish the sentence."}, {"role": "assistant", "content": start}]
    extra = {"echo": True, "continue_final_message": True, "add_generation_prompt": False}
    common: dict[str, Any] = dict(model=services.model, messages=messages, max_tokens=4, temperature=0)
    if stream:
        text = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(**common, stream=True, extra_body=extra)
            if c.choices
        )
    else:
        text = client.chat.completions.create(**common, extra_body=extra).choices[0].message.content or ""
    plain = client.chat.completions.create(**common, extra_body={**extra, "echo": False}).choices[0].message.content
    assert text == start + (plain or "")
    assert plain and not plain.startswith(start)
