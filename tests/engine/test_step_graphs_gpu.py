"""Mixed and prefill steps replayed from CUDA graphs (cuda_graphs.py) give the tokens of eager steps: prompts
of many lengths, chunked prefill beside decodes, prefix-cache hits, n=2 (fp32, tiny Llama).

    python3 -m pytest -q -o addopts='' tests/engine/test_step_graphs_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.services.engine.cuda_graphs import GraphShape, QueryKind
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_mixed_step_graphs_give_the_eager_tokens(tiny_model_dir: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 7, 33, 90, 200, 5, 12, 64, 130)]
    prompts.append([*prompts[4][:150], 9, 9, 9])  # shares 150 tokens with prompt 4: prefix-cache hits mid-prompt
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=1 + i % 2) for i in range(len(prompts))]

    def run(graph_tokens: int, enforce_eager: bool) -> tuple[list[list[list[int]]], list[GraphShape]]:
        config = Config.of(
            model=str(tiny_model_dir),
            dtype="float32",
            device="cuda",
            num_kv_blocks=256,  # not a share of the GPU: later tests in this process size theirs from what is free
            max_model_len=512,
            max_num_seqs=16,
            max_num_batched_tokens=128,  # long prompts go in chunks beside the others' decodes
            cuda_graph_max_batch=16,
            cuda_graph_max_tokens=graph_tokens,
            enforce_eager=enforce_eager,
        )
        engine = Engine(config)
        try:
            graphs = engine.runner.graphs
            replayed: list[GraphShape] = []
            if graphs is not None:
                replay = graphs.replay

                def recording_replay(graph_id: int, uses_lora: bool = False) -> torch.Tensor:
                    replayed.append(graphs.shapes[graph_id])
                    return replay(graph_id, uses_lora)

                graphs.replay = recording_replay  # type: ignore[method-assign]
            results = engine.generate(prompts, params)
            return [[c.token_ids for c in r.choices] for r in results], replayed
        finally:
            engine.shutdown()

    eager, _ = run(0, enforce_eager=True)
    graphed, replayed = run(128, enforce_eager=False)
    assert graphed == eager
    kinds = {shape.kind for shape in replayed}
    assert kinds == {QueryKind.DECODE, QueryKind.SHORT, QueryKind.LONG}, kinds
