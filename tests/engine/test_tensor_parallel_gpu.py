"""Tensor parallelism on 2 GPUs (NCCL): CUDA graphs with captured all-reduces, overlapped steps and
the Triton kernels give the same greedy tokens as one GPU (fp32, tiny Llama with 2 KV heads).

    python3 -m pytest -q -o addopts='' --confcutdir=tests/engine tests/engine/test_tensor_parallel_gpu.py
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def test_tp2_on_gpus_equals_tp1(tiny_model_dir: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 7, 33, 90, 5, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(tp: int) -> tuple[list[list[int]], int]:
        config = Config.of(
            model=str(tiny_model_dir),
            dtype="float32",
            device="cuda",
            tensor_parallel_size=tp,
            num_kv_blocks=256,  # a count, not a share of free memory: rank 0 still held the TP=1 run's cache
            max_model_len=512,
            cuda_graph_max_batch=8,
        )
        engine = Engine(config)
        try:
            graphs = engine.runner.graphs
            assert engine.is_async and graphs is not None
            replay, num_replays = graphs.replay, [0]

            def counting_replay(graph_id: int, uses_lora: bool = False) -> torch.Tensor:
                num_replays[0] += 1
                return replay(graph_id, uses_lora)

            graphs.replay = counting_replay  # type: ignore[method-assign]
            outputs = [r.token_ids for r in engine.generate(prompts, params)]
            return outputs, num_replays[0]
        finally:
            engine.shutdown()
            del engine
            gc.collect()  # the TP=1 engine's cache (a share of GPU 0) must be gone before TP=2 sizes its own
            torch.cuda.empty_cache()

    one, _ = run(1)
    two, num_replays = run(2)
    assert num_replays > 10  # steps ran as graphs (with their captured all-reduces)
    assert two == one
