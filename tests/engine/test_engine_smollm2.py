"""The real SmolLM2 weights (fp32, CPU) through the whole engine vs HF transformers `generate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config

NUM_NEW = 32
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize "
    "foods from carbon dioxide and water. In plants, it",
    "Q: What is the boiling point of water at sea level?\nA:",
    'import numpy as np\n\ndef normalize(x):\n    """Scale a vector to unit length."""\n',
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown "
    "fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. Then the fox",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    token_ids = [tokenizer.encode(text) for text in TEXTS]
    assert len({len(t) for t in token_ids}) == len(token_ids)  # all different lengths
    return token_ids


@pytest.fixture(scope="module")
def hf_greedy(hf_smol, prompts: list[list[int]]) -> list[list[int]]:
    """HF `generate`, greedy, all prompts in one left-padded batch (3x faster than one by one, and
    token for token the same on these prompts)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf_smol.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NUM_NEW, do_sample=False)
    return out[:, width:].tolist()


def make_engine(model: CausalLM, model_dir: Path, **overrides) -> Engine:
    options = {"num_kv_blocks": 128, **overrides}
    return Engine(Config.of(model=str(model_dir), **options), model=model)


def test_batched_greedy_matches_hf(smol_model, smollm2_dir, prompts, hf_greedy) -> None:
    engine = make_engine(smol_model, smollm2_dir)
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == hf_greedy
    assert all(r.finish_reason == "length" for r in results)
    stats = engine.stats()
    assert stats.num_generated_tokens == NUM_NEW * len(prompts)
    assert stats.num_free_blocks == stats.num_total_blocks


def greedy(num_new: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)


# The variants below reuse the HF reference; fewer new tokens keep them fast (a prefix of greedy
# output is the greedy output of fewer tokens).


def test_chunked_prefill_matches_hf(smol_model, smollm2_dir, prompts, hf_greedy) -> None:
    engine = make_engine(smol_model, smollm2_dir, max_num_batched_tokens=13)
    chosen = [7, 4, 6, 0]  # the longest prompts (up to 4 chunks each), and a short one
    results = engine.generate([prompts[i] for i in chosen], greedy(8))
    assert [r.token_ids for r in results] == [hf_greedy[i][:8] for i in chosen]
    assert max(len(prompts[i]) for i in chosen) > 3 * 13


def test_preemption_matches_hf(smol_model, smollm2_dir, prompts, hf_greedy) -> None:
    chosen = [7, 4, 6, 2]
    num_new = 16
    needed = sum(-(-(len(prompts[i]) + num_new) // 16) for i in chosen)
    engine = make_engine(smol_model, smollm2_dir, num_kv_blocks=needed * 2 // 3, enable_prefix_caching=False)
    results = engine.generate([prompts[i] for i in chosen], greedy(num_new))
    assert [r.token_ids for r in results] == [hf_greedy[i][:num_new] for i in chosen]
    assert engine.stats().num_preemptions > 0


def test_prefix_cache_hits_match_hf_and_save_compute(smol_model, smollm2_dir, prompts, hf_greedy) -> None:
    chosen = [7, 4, 6]
    engine = make_engine(smol_model, smollm2_dir)
    engine.generate([prompts[i] for i in chosen], greedy(1))  # fills the cache with the prompts' blocks
    cold = engine.stats()
    again = engine.generate([prompts[i] for i in chosen], greedy(8))
    warm = engine.stats()
    assert [r.token_ids for r in again] == [hf_greedy[i][:8] for i in chosen]
    hit_tokens = warm.num_prefix_cache_hit_tokens - cold.num_prefix_cache_hit_tokens
    assert hit_tokens == sum((len(prompts[i]) - 1) // 16 * 16 for i in chosen) > 0
    assert all(r.num_cached_tokens > 0 for r in again)
    num_prompt_tokens = sum(len(prompts[i]) for i in chosen)
    assert cold.num_computed_tokens == num_prompt_tokens
    assert warm.num_computed_tokens - cold.num_computed_tokens == num_prompt_tokens - hit_tokens + 7 * len(chosen)


def test_logprobs_match_hf_log_softmax(smol_model, smollm2_dir, prompts, hf_smol) -> None:
    engine = make_engine(smol_model, smollm2_dir)
    prompt = prompts[5]
    result = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True))[0]
    with torch.no_grad():
        logits = hf_smol(torch.tensor([prompt + result.token_ids])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [6, vocab]: the step's distribution
    assert result.logprobs is not None and len(result.logprobs) == 6
    for step, entry in enumerate(result.logprobs):
        assert entry.token_id == result.token_ids[step]
        assert entry.logprob == pytest.approx(float(expected[step, entry.token_id]), abs=2e-4)
        top = expected[step].topk(5)
        assert [t for t, _ in entry.top_logprobs] == top.indices.tolist()
        assert [v for _, v in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=2e-4)


def test_text_prompts_decode_to_text(smol_model, smollm2_dir) -> None:
    engine = make_engine(smol_model, smollm2_dir)
    result = engine.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert result.text is not None and "Paris" in result.text
