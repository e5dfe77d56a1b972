"""The tokenizer service's prompt processing: chat templates, length checks at the boundary, token-id checks."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from pagedserve.services.tokenizer.processor import ModelLimits, PromptProcessor, read_limits
from pagedserve.shared.prompts import chat_prompt_ids, check_template_kwargs, text_prompt_ids
from pagedserve.shared.protocol import Accepted, ChatRequest, CompletionRequest, GenerateRequest, RequestError

LIMIT = 64
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def processor(tokenizer: Any, smollm2_dir: Path) -> PromptProcessor:
    return PromptProcessor(tokenizer, read_limits(smollm2_dir, LIMIT))


def chat(max_tokens: int | None = None, messages: list[dict[str, Any]] = MESSAGES, **sampling: Any) -> ChatRequest:
    return ChatRequest("r1", "gw", "m", messages, sampling=sampling, max_tokens=max_tokens)


def completion(prompt: str | list[int], max_tokens: int | None = None, **sampling: Any) -> CompletionRequest:
    return CompletionRequest("r2", "gw", "m", prompt, sampling=sampling, max_tokens=max_tokens)


def error_of(result: Any) -> RequestError:
    assert isinstance(result, RequestError), result
    return result


def test_read_limits(smollm2_dir: Path) -> None:
    limits = read_limits(smollm2_dir, None)
    assert (limits.max_model_len, limits.eos_token_ids, limits.vocab_size) == (8192, [2], 49152)
    with pytest.raises(ValueError):
        read_limits(smollm2_dir, 10**6)


def test_chat_prompt_is_the_hf_chat_template(processor: PromptProcessor, tokenizer: Any) -> None:
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    result = processor.process(chat(max_tokens=5, temperature=0.0))
    assert not isinstance(result, RequestError)
    accepted, generate = result
    assert isinstance(accepted, Accepted) and isinstance(generate, GenerateRequest)
    assert generate.prompt_token_ids == accepted.prompt_token_ids == list(expected)
    assert accepted.num_prompt_tokens == len(expected) and generate.sampling == {"temperature": 0.0, "max_tokens": 5}
    assert chat_prompt_ids(tokenizer, MESSAGES) == list(expected)  # the function /tokenize uses too
    without = chat_prompt_ids(tokenizer, MESSAGES, add_generation_prompt=False)
    assert list(expected)[: len(without)] == without and len(without) < len(expected)


def test_context_boundary_exactly_at_the_limit_works_one_over_fails(processor: PromptProcessor) -> None:
    prompt = list(range(100, 140))  # 40 token ids
    ok = processor.process(completion(prompt, max_tokens=LIMIT - 40))
    assert not isinstance(ok, RequestError) and ok[0].max_tokens == LIMIT - 40
    over = error_of(processor.process(completion(prompt, max_tokens=LIMIT - 39)))
    assert (over.status, over.code, over.param) == (400, "context_length_exceeded", "max_tokens")
    rest = processor.process(completion(prompt))  # no max_tokens: whatever context is left
    assert not isinstance(rest, RequestError) and rest[1].sampling["max_tokens"] == LIMIT - 40
    full = error_of(processor.process(completion(list(range(100, 100 + LIMIT)))))
    assert (full.code, full.param) == ("context_length_exceeded", "prompt")
    long_chat = error_of(processor.process(chat(messages=[{"role": "user", "content": "word " * LIMIT}])))
    assert (long_chat.code, long_chat.param) == ("context_length_exceeded", "messages")


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (completion([5, 49152], max_tokens=2), "prompt"),
        (completion([5, -1], max_tokens=2), "prompt"),
        (completion("", max_tokens=2), "prompt"),
        (completion("hi", max_tokens=2, min_tokens=3), "min_tokens"),
        (completion("hi", max_tokens=2, stop_token_ids=[49152]), "stop_token_ids"),
        (completion("hi", max_tokens=2, logit_bias={"49152": 1.0}), "logit_bias"),
        (completion("hi", max_tokens=2, logit_bias={"x": 1.0}), "logit_bias"),  # garbage from the wire: no crash
        (
            ChatRequest("r", "gw", "m", MESSAGES, chat_template_kwargs={"chat_template": "{{ 1 }}"}),
            "chat_template_kwargs",
        ),
        (ChatRequest("r", "gw", "m", [{"role": "user"}]), "messages"),  # the template fails: a 400, not a crash
    ],
)
def test_bad_requests_are_400_naming_the_param(processor: PromptProcessor, request_: Any, param: str) -> None:
    error = error_of(processor.process(request_))
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", param), error.message


def test_template_kwargs_are_template_variables_only(tokenizer: Any) -> None:
    check_template_kwargs({"enable_thinking": False})
    for key in ("chat_template", "tools", "tokenize", "add_generation_prompt", "return_dict", "truncation"):
        with pytest.raises(ValueError, match=key):
            check_template_kwargs({key: 1}, tokenizer)
    assert chat_prompt_ids(tokenizer, MESSAGES, {"some_flag": True}) == chat_prompt_ids(tokenizer, MESSAGES)


def test_text_prompts(tokenizer: Any) -> None:
    assert text_prompt_ids(tokenizer, "Hello world") == tokenizer.encode("Hello world")
    assert text_prompt_ids(tokenizer, [7, 8]) == [7, 8]
    limits = ModelLimits(max_model_len=16, eos_token_ids=[2])  # no vocab_size: the tokenizer's length
    result = PromptProcessor(tokenizer, limits).process(completion("Hello", max_tokens=2, stop_token_ids=[49151]))
    assert not isinstance(result, RequestError)


def _prompt_ids(result: Any) -> list[int]:
    assert not isinstance(result, RequestError), result
    return result[0].prompt_token_ids


def test_continue_final_message_and_add_generation_prompt_match_hf(processor: PromptProcessor, tokenizer: Any) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "The capital of France is"}]
    req = chat(messages=messages)
    req.add_generation_prompt, req.continue_final_message = False, True
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, tokenize=True, return_dict=False
    )
    assert _prompt_ids(processor.process(req)) == list(expected)
    assert tokenizer.decode(expected).endswith("The capital of France is")  # the turn is left open
    plain = chat()
    plain.add_generation_prompt = False
    assert _prompt_ids(processor.process(plain)) == list(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=True, return_dict=False)
    )


def test_documents_reach_a_template_that_takes_them(tokenizer: Any, smollm2_dir: Path) -> None:
    rag = copy.copy(tokenizer)
    rag.chat_template = (
        "{% for d in documents %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    processor = PromptProcessor(rag, read_limits(smollm2_dir, None))
    req = chat()
    req.documents = [{"title": "Paris", "text": "the capital of France"}]
    text = rag.decode(_prompt_ids(processor.process(req)))
    assert text.startswith("[doc Paris: the capital of France]")


@pytest.mark.parametrize(("keep", "side"), [(4, "left"), (4, "right"), (-1, "left"), (1000, "left")])
def test_truncate_prompt_tokens_keeps_that_many(
    processor: PromptProcessor, tokenizer: Any, keep: int, side: str
) -> None:
    text = "one two three four five six seven eight nine ten " * 10  # > LIMIT tokens
    full = text_prompt_ids(tokenizer, text)
    result = processor.process(completion(text, max_tokens=1, truncate_prompt_tokens=keep, truncation_side=side))
    if keep == -1:  # the context's worth: still no room for the completion
        assert error_of(result).code == "context_length_exceeded"
        return
    if keep >= len(full):
        assert error_of(result).code == "context_length_exceeded"  # nothing cut: still too long
        return
    assert not isinstance(result, RequestError)
    accepted, generate = result
    assert accepted.num_prompt_tokens == 4  # usage reports the truncated prompt
    assert generate.prompt_token_ids == (full[-4:] if side == "left" else full[:4])
    assert "truncate_prompt_tokens" not in generate.sampling and "truncation_side" not in generate.sampling


def test_generation_config_max_new_tokens_is_the_default_max_tokens(tokenizer: Any, smollm2_dir: Path) -> None:
    processor = PromptProcessor(tokenizer, read_limits(smollm2_dir, LIMIT), default_max_tokens=5)
    omitted = processor.process(chat(temperature=0.5))
    assert not isinstance(omitted, RequestError)
    assert omitted[0].max_tokens == 5 and omitted[1].sampling["max_tokens"] == 5
    assert omitted[1].sampling["temperature"] == 0.5  # the rest of the sampling dict passes as it came
    explicit = processor.process(chat(max_tokens=9))
    assert not isinstance(explicit, RequestError) and explicit[0].max_tokens == 9  # a client's value wins
    room = LIMIT - len(chat_prompt_ids(tokenizer, MESSAGES))
    roomy = PromptProcessor(tokenizer, read_limits(smollm2_dir, LIMIT), default_max_tokens=10**6).process(chat())
    assert not isinstance(roomy, RequestError) and roomy[0].max_tokens == room  # never past the context


def test_reasoning_markers_become_the_engines_token_ids(processor: PromptProcessor, tokenizer: Any) -> None:
    markers = {"starts": ["<think>"], "ends": ["</think>", "Here is my response:"]}
    result = processor.process(completion("Hi", max_tokens=4, reasoning_markers=markers))
    assert not isinstance(result, RequestError)
    sampling = result[1].sampling
    assert "reasoning_markers" not in sampling  # the tokenizer's own field stays here
    assert sampling["reasoning_start_ids"] == [tokenizer.encode("<think>", add_special_tokens=False)]
    ends = [tokenizer.encode(marker, add_special_tokens=False) for marker in markers["ends"]]
    assert sampling["reasoning_end_ids"] == ends and all(ends)
