"""The engine with `kv_cache_dtype="fp8"` on CPU: twice the blocks of a bf16 cache for the same
budget, and SmolLM2's greedy output through an e4m3 cache close to the fp32 cache's."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.model_runner import num_kv_blocks_for
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config

TEXTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a", "1, 2, 3, 4,"]
NUM_NEW = 16


def test_fp8_cache_doubles_blocks_of_a_bf16_cache(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, "bf16", "cpu", show_progress=False)
    budget = 3 << 20
    bf16 = num_kv_blocks_for(model, Config.of(model=str(tiny_model_dir), cpu_kv_cache_bytes=budget), 1024)
    fp8 = num_kv_blocks_for(
        model, Config.of(model=str(tiny_model_dir), cpu_kv_cache_bytes=budget, kv_cache_dtype="fp8"), 1024
    )
    assert bf16 == budget // model.spec.kv_bytes_per_token() // 16
    assert fp8 == 2 * bf16


def test_smollm2_greedy_through_fp8_cache(smol_model: CausalLM, smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
    outputs = {}
    for kv_dtype in ("auto", "fp8"):
        engine = Engine(Config.of(model=str(smollm2_dir), num_kv_blocks=64, kv_cache_dtype=kv_dtype), model=smol_model)
        assert engine.runner.kv_caches[0].dtype == (torch.float8_e4m3fn if kv_dtype == "fp8" else torch.float32)
        outputs[kv_dtype] = engine.generate(prompts, params)
        del engine
    for exact, fp8 in zip(outputs["auto"], outputs["fp8"]):
        assert len(fp8.token_ids) == NUM_NEW
        # e4m3 K/V move logits a little: the first tokens agree, and the chosen tokens' logprobs stay close.
        assert fp8.token_ids[:4] == exact.token_ids[:4], (fp8.token_ids, exact.token_ids)
        agree = next((i for i, (a, b) in enumerate(zip(exact.token_ids, fp8.token_ids)) if a != b), NUM_NEW)
        lp_exact = torch.tensor([lp.logprob for lp in exact.logprobs or []][:agree])
        lp_fp8 = torch.tensor([lp.logprob for lp in fp8.logprobs or []][:agree])
        assert float((lp_exact - lp_fp8).abs().max()) < 0.5
