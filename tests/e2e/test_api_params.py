"""Every sampling and output parameter through the official `openai` client, sync and async, streaming
and not, each with an assertion that fails if the parameter were ignored.

CPU budget: all first-round requests go out at once (the engine batches them), then one round that
depends on the greedy answer; every request generates at most 16 tokens.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import RunningServices

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CREATIVE = [{"role": "user", "content": "Write a short poem about the sea."}]
REPEAT = "Repeat after me: hello hello hello hello"
HELLO = "Hello, my name is"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


async def collect_chat_stream(stream: Any) -> dict[str, Any]:
    """Join a chat stream: per choice its text, token logprobs and finish reason; every chunk kept."""
    chunks = [chunk async for chunk in stream]
    texts: dict[int, str] = {}
    logprobs: dict[int, list[Any]] = {}
    finish: dict[int, str | None] = {}
    roles: dict[int, str | None] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            roles.setdefault(choice.index, choice.delta.role)
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.logprobs and choice.logprobs.content:
                logprobs.setdefault(choice.index, []).extend(choice.logprobs.content)
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return {"chunks": chunks, "texts": texts, "logprobs": logprobs, "finish": finish, "roles": roles}


async def collect_completion_stream(stream: Any) -> dict[str, Any]:
    chunks = [chunk async for chunk in stream]
    text, tokens, token_logprobs, offsets, finish = "", [], [], [], None
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs:
                tokens += choice.logprobs.tokens
                token_logprobs += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
            finish = choice.finish_reason or finish
    return {
        "chunks": chunks,
        "text": text,
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "text_offset": offsets,
        "finish": finish,
    }


@pytest.fixture(scope="module")
def blue_id(tokenizer: Any) -> int:
    ids = tokenizer.encode(" blue")
    assert len(ids) == 1
    return int(ids[0])


@pytest.fixture(scope="module")
def first_round(services: RunningServices, blue_id: int) -> dict[str, Any]:
    """Every request that needs no earlier answer, sent concurrently; exceptions are kept per request."""
    model = services.model

    async def go() -> dict[str, Any]:
        async with openai.AsyncOpenAI(
            base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=600
        ) as client:
            chat, complete = client.chat.completions.create, client.completions.create
            greedy = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 16}
            sampled = {"model": model, "messages": CREATIVE, "temperature": 1.0, "max_tokens": 8}
            plain = {"model": model, "prompt": REPEAT, "temperature": 0, "max_tokens": 8}
            logprobs = {"model": model, "prompt": HELLO, "temperature": 0, "max_tokens": 6, "logprobs": 2}
            calls = {
                "greedy": chat(**greedy, logprobs=True, top_logprobs=3),
                "greedy_stream": _stream(
                    chat(**greedy, logprobs=True, top_logprobs=3, stream=True, stream_options={"include_usage": True}),
                    collect_chat_stream,
                ),
                "greedy_n2": chat(**{**greedy, "max_tokens": 6}, n=2),
                "top_k_1": chat(**{**greedy, "temperature": 1.0}, extra_body={"top_k": 1}, user="a-user"),
                "top_p_tiny": chat(**{**greedy, "temperature": 1.0}, top_p=0.001),
                "min_p_1": chat(**{**greedy, "temperature": 1.0}, extra_body={"min_p": 1.0}),
                "ignore_eos": chat(**greedy, extra_body={"ignore_eos": True}),
                "min_tokens": chat(**greedy, extra_body={"min_tokens": 12}),
                "max_completion_5": chat(**greedy, max_completion_tokens=5),
                "bias_blue": chat(**{**greedy, "max_tokens": 4}, logit_bias={str(blue_id): 100}),
                "seed_a": chat(**sampled, n=3, seed=1234),
                "seed_b": chat(**sampled, n=3, seed=1234),
                "seed_c": chat(**sampled, n=3, seed=4321),
                "n3_stream": _stream(chat(**sampled, n=3, seed=7, stream=True), collect_chat_stream),
                "continuous": _stream(
                    chat(
                        **{**greedy, "max_tokens": 4},
                        stream=True,
                        stream_options={"include_usage": True, "continuous_usage_stats": True},
                    ),
                    collect_chat_stream,
                ),
                "repeat": complete(**plain),
                "presence": complete(**plain, presence_penalty=2.0),
                "frequency": complete(**plain, frequency_penalty=2.0),
                "repetition": complete(**plain, extra_body={"repetition_penalty": 2.0}),
                "max_5": complete(**{**logprobs, "max_tokens": 5, "logprobs": 1}),
                "logprobs": complete(**logprobs),
                "logprobs_stream": _stream(complete(**logprobs, stream=True), collect_completion_stream),
                "echo": complete(model=model, prompt=HELLO, temperature=0, max_tokens=4, echo=True),
                "echo_stream": _stream(
                    complete(model=model, prompt=HELLO, temperature=0, max_tokens=4, echo=True, stream=True),
                    collect_completion_stream,
                ),
                "echo_ids": complete(model=model, prompt=[19556, 905], temperature=0, max_tokens=2, echo=True),
            }
            results = await asyncio.gather(*calls.values(), return_exceptions=True)
        return dict(zip(calls, results))

    return asyncio.run(go())


async def _stream(call: Any, collect: Any) -> dict[str, Any]:
    return await collect(await call)


def result(first_round: dict[str, Any], name: str) -> Any:
    value = first_round[name]
    if isinstance(value, BaseException):
        raise value
    return value


def test_greedy_logprobs_are_the_models_and_stream_agrees(
    first_round: dict[str, Any], tokenizer: Any, smollm2_dir: Path
) -> None:
    reply = result(first_round, "greedy")
    stream = result(first_round, "greedy_stream")
    text, choice = reply.choices[0].message.content, reply.choices[0]
    assert choice.finish_reason == "stop" and "Paris" in text
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens  # the hidden EOS is listed too
    assert content[-1].token == tokenizer.eos_token
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        top = [t.logprob for t in entry.top_logprobs]
        assert top == sorted(top, reverse=True) and sum(math.exp(v) for v in top) <= 1 + 1e-5
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6
        assert bytes(entry.bytes or []).decode(errors="replace") == entry.token

    # The same numbers as HF transformers on the same prompt and tokens.
    prompt_ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    output_ids = [*tokenizer.encode(text), tokenizer.eos_token_id]
    assert len(output_ids) == len(content)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + output_ids])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    for i, (token_id, entry) in enumerate(zip(output_ids, content)):
        assert abs(expected[i, token_id].item() - entry.logprob) < 2e-3, (i, tokenizer.decode([token_id]))

    # Streaming gives the same text, tokens and logprobs, the role first, and usage last.
    assert stream["texts"] == {0: text} and stream["finish"] == {0: "stop"} and stream["roles"][0] == "assistant"
    streamed = stream["logprobs"][0]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(streamed, content))
    last = stream["chunks"][-1]
    assert last.choices == [] and last.usage.completion_tokens == reply.usage.completion_tokens
    assert all(c.usage is None for c in stream["chunks"][:-1])
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.system_fingerprint and abs(reply.created - stream["chunks"][0].created) < 600
    assert {c.id for c in stream["chunks"]} == {stream["chunks"][0].id} != {reply.id}


def test_greedy_equivalents_and_lengths(first_round: dict[str, Any]) -> None:
    greedy = result(first_round, "greedy")
    text, num_tokens = greedy.choices[0].message.content, greedy.usage.completion_tokens
    assert num_tokens < 12, "the greedy answer must end (EOS) before min_tokens below"
    # Filters that keep only the most likely token turn sampling at temperature 1 into greedy.
    for name in ("top_k_1", "top_p_tiny", "min_p_1"):
        assert result(first_round, name).choices[0].message.content == text, name
    pair = [c.message.content for c in result(first_round, "greedy_n2").choices]
    assert len(pair) == 2 and pair[0] == pair[1] and pair[0] and text.startswith(pair[0])  # temperature 0

    no_eos = result(first_round, "ignore_eos")
    assert no_eos.choices[0].finish_reason == "length" and no_eos.usage.completion_tokens == 16
    assert no_eos.choices[0].message.content.startswith(text)
    at_least = result(first_round, "min_tokens")
    assert at_least.usage.completion_tokens >= 12 > num_tokens
    assert at_least.choices[0].message.content.startswith(text)
    five = result(first_round, "max_completion_5")
    assert five.choices[0].finish_reason == "length" and five.usage.completion_tokens == 5
    assert text.startswith(five.choices[0].message.content)


def test_seed_reproduces_and_n_gives_distinct_choices(first_round: dict[str, Any]) -> None:
    a, b, c = (result(first_round, name) for name in ("seed_a", "seed_b", "seed_c"))
    texts_a = [ch.message.content for ch in a.choices]
    assert [ch.index for ch in a.choices] == [0, 1, 2] and len(texts_a) == 3
    assert texts_a == [ch.message.content for ch in b.choices]
    assert texts_a != [ch.message.content for ch in c.choices]
    assert len(set(texts_a)) > 1, "choices of one request are different samples"
    assert 3 <= a.usage.completion_tokens <= 3 * 8  # usage counts every choice

    stream = result(first_round, "n3_stream")
    assert set(stream["texts"]) == {0, 1, 2} and set(stream["finish"]) == {0, 1, 2}
    assert all(stream["roles"][i] == "assistant" for i in range(3))
    assert len(set(stream["texts"].values())) > 1


def test_logit_bias_forces_a_token(first_round: dict[str, Any]) -> None:
    reply = result(first_round, "bias_blue")
    assert reply.choices[0].message.content == " blue" * 4


def test_penalties_change_a_repetitive_greedy_output(first_round: dict[str, Any]) -> None:
    base = result(first_round, "repeat").choices[0].text
    assert "hello hello" in base, base
    for name in ("presence", "frequency", "repetition"):
        penalized = result(first_round, name).choices[0].text
        assert penalized != base, name
        assert penalized.count("hello") < base.count("hello"), (name, penalized)


def test_completion_logprobs_lengths_and_streaming(first_round: dict[str, Any]) -> None:
    five = result(first_round, "max_5")
    assert five.choices[0].finish_reason == "length" and five.usage.completion_tokens == 5
    assert len(five.choices[0].logprobs.tokens) == 5 and five.object == "text_completion"
    assert five.id.startswith("cmpl-")

    reply = result(first_round, "logprobs").choices[0]
    lp = reply.logprobs
    assert "".join(lp.tokens) == reply.text and len(lp.tokens) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    stream = result(first_round, "logprobs_stream")
    assert stream["text"] == reply.text and stream["tokens"] == lp.tokens
    assert stream["text_offset"] == lp.text_offset
    assert all(abs(a - b) < 1e-3 for a, b in zip(stream["token_logprobs"], lp.token_logprobs))


def test_echo_prepends_the_prompt(first_round: dict[str, Any]) -> None:
    echoed = result(first_round, "echo").choices[0].text
    streamed = result(first_round, "echo_stream")
    assert echoed.startswith(HELLO) and len(echoed) > len(HELLO)
    assert streamed["text"] == echoed
    assert streamed["chunks"][0].choices[0].text == HELLO  # the prompt comes first, on its own
    assert result(first_round, "echo_ids").choices[0].text.startswith("Hello world")


def test_continuous_usage_stats(first_round: dict[str, Any]) -> None:
    stream = result(first_round, "continuous")
    counts = [c.usage.completion_tokens for c in stream["chunks"]]
    assert all(c.usage is not None and c.usage.prompt_tokens > 0 for c in stream["chunks"])
    assert counts == sorted(counts) and counts[-1] == 4 and stream["chunks"][-1].choices == []


def test_stop_strings_stop_token_ids_and_negative_bias(
    services: RunningServices, first_round: dict[str, Any], tokenizer: Any
) -> None:
    """Second round (sync client, from threads): requests built from the greedy answer."""
    greedy = result(first_round, "greedy")
    text = greedy.choices[0].message.content
    greedy_ids = tokenizer.encode(text)
    stop_word = text.split()[1]  # "capital" in "The capital of France is Paris."
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=600)
    base = {"model": services.model, "messages": QUESTION, "temperature": 0, "max_tokens": 16}

    def stream_text(**kwargs: Any) -> tuple[dict[int, str], dict[int, str]]:
        texts: dict[int, str] = {}
        finish: dict[int, str] = {}
        for chunk in client.chat.completions.create(**base, stream=True, **kwargs):
            for ch in chunk.choices:
                texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
                if ch.finish_reason:
                    finish[ch.index] = ch.finish_reason
        return texts, finish

    calls = {
        "stop": lambda: client.chat.completions.create(**base, stop=["never-appears", stop_word]),
        "stop_stream_n2": lambda: stream_text(stop=stop_word, n=2),
        "stop_token": lambda: client.chat.completions.create(**base, extra_body={"stop_token_ids": [greedy_ids[2]]}),
        "ban_first": lambda: client.chat.completions.create(
            **base, logit_bias={str(greedy_ids[0]): -100}, logprobs=True
        ),
    }
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        out = {name: f.result() for name, f in futures.items()}

    cut = text[: text.index(stop_word)]
    stop = out["stop"].choices[0]
    assert (stop.message.content, stop.finish_reason) == (cut, "stop")
    assert out["stop_stream_n2"] == ({0: cut, 1: cut}, {0: "stop", 1: "stop"})
    by_token = out["stop_token"]
    assert by_token.choices[0].finish_reason == "stop" and by_token.usage.completion_tokens == 3
    assert by_token.choices[0].message.content == tokenizer.decode(greedy_ids[:2])
    banned = out["ban_first"].choices[0]
    assert banned.logprobs.content[0].token != tokenizer.decode(greedy_ids[:1])
    assert banned.message.content != text
