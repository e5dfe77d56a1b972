"""Prompt logprobs through the whole engine (real SmolLM2, fp32 CPU) vs HF's log-softmax."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.outputs import TokenLogprob
from pagedserve.services.engine.prompt_logprobs import PromptLogprobs, accumulate
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config

TEXTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. Then the fox",
    "Q: What is the boiling point of water at sea level?\nA: 100 degrees Celsius.",
]


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return [tokenizer.encode(text) for text in TEXTS]


@pytest.fixture(scope="module")
def hf_prompt_logprobs(hf_smol, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt: [len - 1, vocab] log-softmax of the positions that predict tokens 1.."""
    with torch.no_grad():
        return [torch.log_softmax(hf_smol(torch.tensor([p])).logits[0, :-1].float(), dim=-1) for p in prompts]


def _engine(model: CausalLM, model_dir: Path, **overrides) -> Engine:
    return Engine(Config.of(model=str(model_dir), **{"num_kv_blocks": 128, **overrides}), model=model)


def _check(prompt: list[int], got, expected: torch.Tensor, k: int) -> None:
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None  # the first token has no context
    for position in range(1, len(prompt)):
        entry, row = got[position], expected[position - 1]
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(float(row[prompt[position]]), abs=2e-3)
        top = row.topk(k)
        assert [v for _, v in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=2e-3)
        assert len(entry.top_logprobs) == k


def test_prompt_logprobs_match_hf(smol_model, smollm2_dir, prompts, hf_prompt_logprobs) -> None:
    engine = _engine(smol_model, smollm2_dir)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=3)
    results = engine.generate(prompts, params)
    for prompt, result, expected in zip(prompts, results, hf_prompt_logprobs):
        _check(prompt, result.prompt_logprobs, expected, 3)
        assert len(result.token_ids) == 3


def test_chunked_prefill_and_prefix_cache(smol_model, smollm2_dir, prompts, hf_prompt_logprobs) -> None:
    """Chunks of 8 tokens, and a prompt whose blocks are all in the prefix cache already."""
    engine = _engine(smol_model, smollm2_dir, max_num_batched_tokens=8, block_size=4)
    engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2))  # fills the cache
    plain = engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None  # the cache works; nobody asked
    result = engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))[0]
    assert result.num_cached_tokens == 0  # prompt logprobs need every position computed
    _check(prompts[0], result.prompt_logprobs, hf_prompt_logprobs[0], 0)
    assert result.token_ids == plain.token_ids


def test_n_choices_and_neighbours_pay_nothing(smol_model, smollm2_dir, prompts, hf_prompt_logprobs) -> None:
    engine = _engine(smol_model, smollm2_dir)
    params = [
        SamplingParams(temperature=0.0, max_tokens=4, n=2, prompt_logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=4),
    ]
    with_logprobs, without = engine.generate(prompts, params)
    _check(prompts[0], with_logprobs.prompt_logprobs, hf_prompt_logprobs[0], 1)
    assert without.prompt_logprobs is None
    assert with_logprobs.choices[0].token_ids == with_logprobs.choices[1].token_ids  # greedy


def test_prompt_logprobs_are_validated(smol_model, smollm2_dir) -> None:
    engine = _engine(smol_model, smollm2_dir)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request("bad", [1, 2, 3], SamplingParams(prompt_logprobs=21))


def test_chunks_accumulate_each_position_once() -> None:
    """Chunked prefill (and a recompute after preemption) may report a position twice: the first stays."""

    def entry(token_id: int) -> TokenLogprob:
        return TokenLogprob(token_id, -float(token_id), [])

    collected: list[TokenLogprob | None] = []
    accumulate(collected, PromptLogprobs(None, 1, [entry(1), entry(2)]))
    accumulate(collected, PromptLogprobs(None, 2, [entry(99), entry(3)]))
    accumulate(collected, PromptLogprobs(None, 5, [entry(5)]))  # a gap: not appended
    assert collected[0] is None
    assert [e.token_id for e in collected[1:] if e is not None] == [1, 2, 3]
