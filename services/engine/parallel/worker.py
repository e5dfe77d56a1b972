"""A tensor-parallel worker rank: build the same shard, then follow rank 0's steps until told to stop.

It mirrors the engine's start-up call for call, because each of these runs collectives that every
rank must enter in the same order: load (no collectives), the KV-cache sizing forward (CUDA), the
agreed block count, the CUDA graph captures (warm-up), then one `follow_step` per step rank 0 runs.
It never samples: rank 0 alone owns the scheduler, the sampler and the Redis side.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time

import torch

from services.engine.config import EngineConfig
from services.engine.input_batch import to_model_input
from services.engine.model_runner import ModelRunner
from services.engine.parallel.state import ParallelContext, init_parallel, shutdown_parallel
from services.engine.parallel.step_broadcast import StepMessage, StepReceiver

log = logging.getLogger("services.engine.parallel.worker")


def build_runner(config: EngineConfig, ctx: ParallelContext) -> ModelRunner:
    """What `Engine.__init__` does up to its runner, in the same order (see the module docstring)."""
    from services.engine.engine import _fit_max_model_len, _select_attention_backend
    from services.engine.model_runner import num_kv_blocks_for
    from services.engine.parallel.launcher import build_rank_model

    device = config.torch_device
    model = build_rank_model(config, ctx)
    _select_attention_backend(device)
    num_blocks = ctx.agree_min(num_kv_blocks_for(model, config, model.spec.max_model_len))
    max_model_len = _fit_max_model_len(config, model.spec.max_model_len, num_blocks)
    return ModelRunner(model, num_blocks, config.block_size, device, config.seed, max_num_seqs=config.max_num_seqs,
                       max_num_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
                       cuda_graph_max_batch=config.cuda_graph_max_batch,
                       kv_cache_dtype=config.kv_cache_torch_dtype)  # fmt: skip


@torch.inference_mode()
def follow_step(runner: ModelRunner, ctx: ParallelContext, message: StepMessage) -> None:
    """Run rank 0's step on this rank's shard: the same inputs, the same collectives, no sampling."""
    batch = message.batch
    assert batch is not None
    inputs = to_model_input(batch, runner.device) if runner.buffers is None else runner.buffers.load(batch)
    if batch.patch_rows.shape[0] > 0:
        ctx.broadcast_from_driver(inputs.input_ids)  # rank 0's ids with the placeholders filled in
    if message.graph_size is not None:
        assert runner.graphs is not None
        hidden = runner.graphs.replay(message.graph_size)
    else:
        hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
    if batch.logits_rows.shape[0] > 0:
        runner.model.compute_logits(hidden[inputs.logits_rows])  # joins the logits all-gather


def serve_steps(runner: ModelRunner, ctx: ParallelContext) -> None:
    receiver = StepReceiver(ctx)
    # Staging buffers are reused every other step: wait for the copies of two steps ago first.
    done: list[torch.cuda.Event | None] = [None, None]
    num_steps = 0
    while True:
        message = receiver.recv()
        if message.batch is None:
            return
        slot = num_steps % 2
        previous = done[slot]
        if previous is not None:
            previous.synchronize()
        follow_step(runner, ctx, message)
        if runner.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            done[slot] = event
        num_steps += 1


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            log.error("rank 0 (pid %d) is gone: exiting", parent_pid)
            logging.shutdown()
            os._exit(1)
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description="pagedserve tensor-parallel worker rank (started by rank 0)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--num-threads", type=int, default=0)
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    # Rank 0 alone decides when the replica ends (drain, then a stop message); a terminal's Ctrl-C or a
    # supervisor's SIGTERM to the whole process group must not cut a worker out from under a drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    config = EngineConfig(**json.loads(args.config))
    ctx = init_parallel(args.rank, args.world_size, args.init_method, config.torch_device, config.parallel_timeout_s)
    runner = build_runner(config, ctx)
    if config.torch_device.type == "cuda" and config.warm_up:
        runner.capture_graphs()
    log.info("rank %d ready", args.rank)
    serve_steps(runner, ctx)
    log.info("rank %d stopped", args.rank)
    shutdown_parallel()
    logging.shutdown()
    os._exit(0)  # skip interpreter teardown: CUDA/NCCL destructors have nothing left to do here


if __name__ == "__main__":
    main()
