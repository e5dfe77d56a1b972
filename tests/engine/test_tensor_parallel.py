"""Tensor parallelism through the whole engine: SmolLM2 (fp32, CPU, gloo) on 2 ranks vs 1 rank.

SmolLM2 has 9 query heads and 3 KV heads, so its 2 ranks hold unequal shards (3+1 and 6+2 heads).
One TP=2 engine serves the module (this process is rank 0; it starts rank 1): overlapped steps
(async scheduling, so the input-id broadcast runs), chunked prefill and a small KV cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config

NUM_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and",
    "import numpy as np\n\ndef normalize(x):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. Then the fox",
]


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return [tokenizer.encode(text) for text in TEXTS]


@pytest.fixture(scope="module")
def reference(smol_model: CausalLM, smollm2_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """One rank, the plain (unsharded) model."""
    engine = Engine(Config.of(model=str(smollm2_dir), num_kv_blocks=128), model=smol_model)
    return [r.token_ids for r in engine.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def tp_engine(smollm2_dir: Path) -> Iterator[Engine]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # two ranks share this machine's cores
    config = Config.of(
        model=str(smollm2_dir),
        tensor_parallel_size=2,
        num_kv_blocks=12,
        max_num_batched_tokens=64,
        async_scheduling=True,
        parallel_timeout_s=60,
    )
    engine = Engine(config)
    yield engine
    engine.shutdown()
    torch.set_num_threads(previous)


def test_rank_shards_are_uneven_for_smollm2(tp_engine: Engine) -> None:
    spec = tp_engine.runner.spec
    assert (spec.num_heads, spec.num_kv_heads) == (3, 1)  # rank 0 of 9/3 heads; rank 1 holds 6/2
    assert tp_engine.executor.world_size == 2 and len(tp_engine.executor.worker_pids) == 1
    assert tp_engine.runner.kv_caches[0].shape[3] == 1


def test_greedy_tp2_equals_tp1(tp_engine: Engine, prompts: list[list[int]], reference: list[list[int]]) -> None:
    got = [r.token_ids for r in tp_engine.generate(prompts[:4], GREEDY)]
    assert got == reference[:4]


def test_preemption_with_tp2(tp_engine: Engine, prompts: list[list[int]], reference: list[list[int]]) -> None:
    before = tp_engine.stats().num_preemptions
    got = [r.token_ids for r in tp_engine.generate(prompts, GREEDY)]  # 8 sequences, 12 blocks of 16
    assert tp_engine.stats().num_preemptions > before
    assert got == reference
    assert tp_engine.stats().num_free_blocks == tp_engine.stats().num_total_blocks


def test_prefix_cache_hit_with_tp2(tp_engine: Engine, prompts: list[list[int]], reference: list[list[int]]) -> None:
    long_prompt = prompts[7]
    assert len(long_prompt) > 16  # at least one full block to share
    tp_engine.generate([long_prompt], GREEDY)
    hits = tp_engine.stats().num_prefix_cache_hit_tokens
    again = tp_engine.generate([long_prompt], GREEDY)[0].token_ids
    assert tp_engine.stats().num_prefix_cache_hit_tokens > hits
    assert again == reference[7]


def test_abort_with_tp2(tp_engine: Engine, prompts: list[list[int]], reference: list[list[int]]) -> None:
    tp_engine.add_request("keep", prompts[0], GREEDY)
    tp_engine.add_request("drop", prompts[1], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    tokens: dict[str, list[int]] = {"keep": [], "drop": []}
    finish: dict[str, str | None] = {}
    num_steps = 0
    while tp_engine.has_unfinished():
        for out in tp_engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
        num_steps += 1
        if num_steps == 4:
            tp_engine.abort(["drop"])
    assert finish == {"keep": "length", "drop": "abort"}
    assert tokens["keep"] == reference[0]
    assert 0 < len(tokens["drop"]) < 100 and tokens["drop"] == reference[1][: len(tokens["drop"])]
    assert tp_engine.stats().num_free_blocks == tp_engine.stats().num_total_blocks
