"""One rank of the tensor-parallel family test (`python -m tests.models.tp_rank ...`, started twice).

Every rank loads each tiny checkpoint's shard and runs the same greedy batch through `PagedDriver`
(so every rank enters the same collectives); rank 0 writes the tokens as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.parallel.state import init_parallel, shutdown_parallel
from tests.models.paged_driver import PagedDriver


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument(
        "--job", required=True, help="JSON: {prompts, num_new, models: {case: dir}, random, logits, quantized_experts}"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    job = json.loads(Path(args.job).read_text())
    ctx = init_parallel(args.rank, args.world_size, args.init_method, torch.device("cpu"), timeout_s=120)
    results: dict[str, list[list[int]] | list[list[float]]] = {}
    for case, model_dir in job["models"].items():
        quantized_experts = True if case in job.get("quantized_experts", ()) else None  # as CUDA keeps them
        model = load_model(
            model_dir, "float32", "cpu", show_progress=False, parallel=ctx, quantized_experts=quantized_experts
        )
        if case in job.get("logits", ()):  # the prompts' last-position logits (where tokens may not be exact)
            logits = PagedDriver(model).step(dict(enumerate(job["prompts"])))
            results[case] = [lg[-1].tolist() for lg in logits]
        else:
            results[case] = PagedDriver(model).greedy(job["prompts"], job["num_new"])
    model = load_model(job["random"], "float32", "cpu", show_progress=False, parallel=ctx, random_weights_seed=7)
    results["random-weights"] = PagedDriver(model).greedy(job["prompts"], job["num_new"])
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(results))
    shutdown_parallel()


if __name__ == "__main__":
    main()
