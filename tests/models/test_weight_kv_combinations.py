"""Every weight format with each KV-cache dtype through the engine (the README's weight x KV table): each
checkpoint serves with a full-precision and with an fp8 KV cache, and the fp8 cache is really e4m3. The
formats' correctness is each one's own test file, the fp8 cache's is tests/engine/test_fp8_kv_engine.py
(SmolLM2 vs HF); these tiny random models are too sensitive to compare an fp8 cache's tokens with (a wide
init: e4m3's 3 mantissa bits change even the first token of the bf16 model)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config
from tests.models.test_compressed_int8 import _checkpoint as int8_checkpoint
from tests.models.test_compressed_tensors import _checkpoint as pack_quantized_checkpoint
from tests.models.test_fp8_block import write_block_fp8
from tests.models.test_gptq8 import _checkpoint as gptq8_checkpoint
from tests.models.test_int4_models import _quantize_checkpoint as int4_checkpoint
from tests.models.test_mxfp4 import CASE as GPT_OSS_CASE
from tests.models.test_mxfp4 import write_mxfp4_checkpoint
from tests.models.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
LLAMA = "llama-gqa-tied-llama3rope-sharded"


def _mxfp4(model_dir: Path) -> None:
    bf16 = model_dir.parent / f"{model_dir.name}-bf16"
    write_mxfp4_checkpoint(build_tiny_model(GPT_OSS_CASE, bf16), bf16, model_dir)


CHECKPOINTS: dict[str, tuple[Callable[[Path], object], str | None]] = {
    "bf16": (lambda d: build_tiny_model(LLAMA, d), None),
    "fp8-online": (lambda d: build_tiny_model(LLAMA, d), "fp8"),
    "awq": (lambda d: int4_checkpoint(d, "awq", False), None),
    "gptq-act-order": (lambda d: int4_checkpoint(d, "gptq", True), None),
    "compressed-tensors-w4a16": (lambda d: pack_quantized_checkpoint(d, 32, True, False), None),
    "mxfp4": (_mxfp4, None),
    "gptq-8bit": (lambda d: gptq8_checkpoint(d, 32, False), None),
    "compressed-tensors-w8a8-int8": (lambda d: int8_checkpoint(d, "channel", True, False), None),
    "compressed-tensors-w8a16": (lambda d: int8_checkpoint(d, "group", False, True), None),
    "fp8-block": (lambda d: write_block_fp8(LLAMA, d, "fp8"), None),
}


@pytest.mark.parametrize("weights", list(CHECKPOINTS))
def test_each_weight_format_serves_with_an_fp8_kv_cache(weights: str, tmp_path: Path) -> None:
    write, quantization = CHECKPOINTS[weights]
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    write(model_dir)
    prompt = [5, 17, 42, 99, 3, 250, 8, 11, 60, 7]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    runs = {}
    for kv in ("auto", "fp8"):
        config = Config.of(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            quantization=quantization,
            kv_cache_dtype=kv,
            block_size=4,
            num_kv_blocks=32,
        )
        engine = Engine(config)
        cache_dtype = engine.runner.kv_caches[0].dtype
        assert cache_dtype == (torch.float8_e4m3fn if kv == "fp8" else torch.float32), (kv, cache_dtype)
        runs[kv] = engine.generate([prompt], params)[0]
    for kv, result in runs.items():
        assert len(result.token_ids) == 6 and result.logprobs is not None, kv
        assert all(e.logprob <= 0.0 and e.token_id == t for e, t in zip(result.logprobs, result.token_ids)), kv
