"""An /v1/embeddings input in the tokenizer service (services/tokenizer/embeddings.py): tokenized as a
completion prompt, checked against the context (it may use all but the last position) and `dimensions`
against the model's Matryoshka settings, then sent as a pooling request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from pagedserve.services.tokenizer.embeddings import dimensions_problem
from pagedserve.services.tokenizer.processor import ModelLimits, PromptProcessor, read_limits
from pagedserve.shared.protocol import Accepted, CompletionRequest, GenerateRequest, RequestError


@pytest.fixture(scope="module")
def processor(smollm2_dir: Path) -> PromptProcessor:
    limits = ModelLimits(max_model_len=16, eos_token_ids=[2], vocab_size=49152, hidden_size=576, is_matryoshka=True)
    return PromptProcessor(AutoTokenizer.from_pretrained(str(smollm2_dir)), limits)


def embedding(prompt: str | list[int], dimensions: int | None = None, **sampling: Any) -> CompletionRequest:
    return CompletionRequest("e1", "gw", "m", prompt, sampling=sampling, pooling={"dimensions": dimensions})


def error_of(result: Any) -> RequestError:
    assert isinstance(result, RequestError), result
    return result


def test_an_input_becomes_a_pooling_request(processor: PromptProcessor) -> None:
    result = processor.process(embedding("Paris is a city", dimensions=32))
    assert not isinstance(result, RequestError)
    accepted, generate = result
    ids = processor.tokenizer.encode("Paris is a city")
    assert isinstance(accepted, Accepted) and isinstance(generate, GenerateRequest)
    assert accepted.num_prompt_tokens == len(ids) and generate.prompt_token_ids == ids
    assert generate.pooling == {"dimensions": 32} and generate.sampling == {"max_tokens": 1}


def test_length_boundary_all_but_the_last_position(processor: PromptProcessor) -> None:
    assert not isinstance(processor.process(embedding([7] * 15)), RequestError)
    error = error_of(processor.process(embedding([7] * 16)))
    assert (error.status, error.param, error.code) == (400, "input", "context_length_exceeded")
    assert error_of(processor.process(embedding([49152]))).param == "input"  # out of the vocabulary
    kept = processor.process(embedding(list(range(3, 23)), truncate_prompt_tokens=15))  # vLLM's: keep the last 15
    assert not isinstance(kept, RequestError) and kept[1].prompt_token_ids == list(range(8, 23))
    assert kept[1].sampling == {"max_tokens": 1}  # the tokenizer's own fields stop here


def test_dimensions_rules(processor: PromptProcessor, smollm2_dir: Path, tmp_path: Path) -> None:
    assert error_of(processor.process(embedding("hi", dimensions=577))).param == "dimensions"  # > hidden size
    plain = read_limits(smollm2_dir, None)  # SmolLM2's config says nothing of Matryoshka
    assert plain.hidden_size == 576 and not plain.is_matryoshka
    assert dimensions_problem(plain, None) is None
    assert "does not support matryoshka" in (dimensions_problem(plain, 64) or "")
    config = json.loads((smollm2_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [64, 128]}))
    listed = read_limits(tmp_path, None)
    assert listed.is_matryoshka and dimensions_problem(listed, 128) is None
    assert "[64, 128]" in (dimensions_problem(listed, 100) or "")
