"""The executors: one Worker build for every rank, the context limit fit to the KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.services.engine import attention, offline
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.executor import make_executor
from pagedserve.services.engine.executor.uniproc import UniprocExecutor
from pagedserve.services.engine.executor.worker import fit_max_model_len
from pagedserve.services.engine.kv_cache_groups import KVCacheGroup
from pagedserve.services.engine.main import build_engine
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config


def test_one_process_executor_builds_the_runner_the_config_asks_for(tiny_model: CausalLM, tiny_model_dir: Path) -> None:
    config = Config.of(model=str(tiny_model_dir), num_kv_blocks=32, block_size=8, max_num_seqs=4)
    executor = make_executor(config, tiny_model)
    assert isinstance(executor, UniprocExecutor)
    assert (executor.world_size, executor.worker_pids) == (1, [])
    runner = executor.runner
    assert runner.model is tiny_model
    assert (runner.num_blocks, runner.block_size) == (32, 8)
    assert runner.kv_caches[0].shape[1:3] == (32, 8)
    assert runner.max_model_len == 256  # the tiny model's 1024 lowered to what 32 blocks of 8 hold
    executor.shutdown()


def test_tensor_parallel_executor_loads_its_own_shards(tiny_model: CausalLM, tiny_model_dir: Path) -> None:
    config = Config.of(model=str(tiny_model_dir), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="loads its own shards"):
        make_executor(config, tiny_model)


def test_context_limit_never_exceeds_the_kv_cache() -> None:
    config = Config.of(block_size=16)
    assert fit_max_model_len(config, 8192, num_blocks=1000) == 8192
    assert fit_max_model_len(config, 8192, num_blocks=100) == 1600
    with pytest.raises(ValueError, match="max_model_len: 4096 exceeds the KV cache"):
        fit_max_model_len(Config.of(block_size=16, max_model_len=4096), 8192, num_blocks=100)
    # every layer slides: a window (4096) and a prefill chunk (2048) of blocks is all a sequence ever holds
    sliding = [KVCacheGroup(4096, (0, 1))]
    assert fit_max_model_len(config, 32768, num_blocks=400, groups=sliding) == 32768
    assert fit_max_model_len(config, 32768, num_blocks=300, groups=sliding) == 4800  # 386 needed: as before
    # hybrid: the full group holds the context, the sliding group a window and a chunk (387 blocks) of the pool
    hybrid = [KVCacheGroup(None, (1,)), KVCacheGroup(4096, (0,))]
    assert fit_max_model_len(config, 32768, num_blocks=1000, groups=hybrid) == (1000 - 387) * 16
    assert fit_max_model_len(config, 8192, num_blocks=1000, groups=hybrid) == 8192


def test_the_engine_service_builds_its_engine_from_the_config(tiny_model_dir: Path) -> None:
    previous = torch.get_num_threads()
    try:
        engine = build_engine(
            Config.of(model=str(tiny_model_dir), device="cpu", cpu_threads=1, num_kv_blocks=16, block_size=8)
        )
        assert torch.get_num_threads() == 1  # --cpu-threads
        assert attention.backend_name() == attention.default_backend(torch.device("cpu"))
        assert engine.max_model_len == 128 and isinstance(engine.executor, UniprocExecutor)
    finally:
        torch.set_num_threads(previous)


def test_offline_generate_checks_its_params_and_needs_a_tokenizer_only_for_text(
    tiny_model: CausalLM, tiny_model_dir: Path
) -> None:
    engine = Engine(Config.of(model=str(tiny_model_dir), num_kv_blocks=32, block_size=8), model=tiny_model)
    with pytest.raises(ValueError, match="one SamplingParams, or one per prompt"):
        offline.generate(engine, [[5, 6], [7]], [SamplingParams(max_tokens=2)])
    [result] = offline.generate(engine, [[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True, n=2))
    assert [len(c.token_ids) for c in result.choices] == [3, 3] and result.prompt_token_ids == [5, 6, 7]
    assert offline.cached_tokenizer(tiny_model_dir / "no-such-dir", required=False) is None
    with pytest.raises(ValueError, match="text needs a tokenizer"):
        offline.cached_tokenizer(tiny_model_dir / "still-none", required=True)
