"""One rank's model and runner, built the same way on every rank of a replica.

Rank 0 (the engine process) and ranks 1.. (`python -m pagedserve.services.engine.executor.worker`,
started by the multiprocess executor) each build a `Worker`. The build runs collectives that every
rank must enter in the same order: load the shard (no collectives), size the KV cache (a forward on
CUDA), agree on the smallest block count, capture the CUDA graphs (warm-up). Ranks 1.. then follow
rank 0's steps (`follow_steps`) until told to stop; they never sample: rank 0 alone owns the
scheduler, the sampler and the Redis side.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence

import torch

from pagedserve.kernels import launch_config
from pagedserve.services.engine import attention, dense
from pagedserve.services.engine.config import model_dir, torch_device
from pagedserve.services.engine.input_batch import to_model_input
from pagedserve.services.engine.kv_cache_groups import (
    KVCacheGroup,
    capacity_line,
    is_hybrid,
    kv_cache_groups,
    max_context,
)
from pagedserve.services.engine.lora.manager import LoRAManager
from pagedserve.services.engine.model_runner import ModelRunner, num_kv_blocks_for
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.parallel import partial_sums
from pagedserve.services.engine.parallel.state import (
    ParallelContext,
    all_reduce_limits,
    init_parallel,
    shutdown_parallel,
)
from pagedserve.services.engine.parallel.step_broadcast import StepMessage, StepReceiver, StepSender
from pagedserve.services.engine.step_profile import StepProfile
from pagedserve.shared.config import Config

log = logging.getLogger("pagedserve.services.engine.executor.worker")


class Worker:
    """This rank's model shard (`ctx` None: the whole model on one device) and, once built, its runner."""

    def __init__(self, config: Config, ctx: ParallelContext | None = None, model: CausalLM | None = None) -> None:
        self.config, self.ctx = config, ctx
        self.device = torch_device(config)
        if ctx is None and self.device.type == "cuda" and self.device.index is not None:
            # CUDA graph capture, Triton launches and the cuBLAS handles use the *current* device: an
            # engine on cuda:1 must make it current before it allocates anything (init_parallel does
            # this for each rank of a tensor-parallel replica).
            torch.cuda.set_device(self.device)
        self.model = model if model is not None else load_rank_model(config, ctx)
        select_attention_backend(self.device)
        dense.set_gemv_max_rows(config.runner.gemv_max_rows, self.device)
        launch_config.set_pdl(config.runner.pdl)
        refuse_unsupported_attention(self.model)
        self.lora: LoRAManager | None = None
        if config.lora.enable_lora:  # before the KV cache is sized: the slots take device memory too
            if ctx is not None:
                raise ValueError("enable_lora: LoRA adapters with tensor parallelism are not supported yet")
            scheduler = config.scheduler
            num_tokens = max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
            self.lora = LoRAManager(self.model, config.lora, num_tokens, self.device)

    def build_runner(self, profile: StepProfile | None = None, step_sender: StepSender | None = None) -> ModelRunner:
        """Size the KV cache (the smallest of all ranks), fit the context limit to it, build the runner."""
        spec, config = self.model.spec, self.config
        groups = kv_cache_groups(spec.layer_windows, spec.num_layers)
        if is_hybrid(groups) and not use_hybrid_kv_cache(config):
            groups = kv_cache_groups(spec.layer_windows, spec.num_layers, hybrid=False)
        num_blocks = num_kv_blocks_for(self.model, config, spec.max_model_len, groups)
        if self.ctx is not None:
            num_blocks = self.ctx.agree_min(num_blocks)
        if is_hybrid(groups):
            chunk = config.scheduler.max_num_batched_tokens
            log.info("%s", capacity_line(groups, num_blocks, config.cache.block_size, chunk))
        max_model_len = fit_max_model_len(config, spec.max_model_len, num_blocks, groups)
        return ModelRunner.from_config(
            self.model,
            config,
            num_blocks,
            max_model_len,
            profile=profile,
            step_sender=step_sender,
            lora=self.lora,
            kv_groups=groups,
        )


def use_hybrid_kv_cache(config: Config) -> bool:
    """Whether the sliding layers of a model that mixes them with global ones get KV blocks of their own
    (freed once out of the window; kv_cache_groups.py). Not with a host KV tier: it keeps one copy of a prefix
    block for every layer, so every layer keeps every block (said once at start)."""
    cache = config.cache
    if cache.disable_hybrid_kv_cache_manager:
        return False
    if cache.kv_offload_gb > 0 and cache.enable_prefix_caching:
        log.warning(
            "kv_offload_gb: the host KV tier keeps every layer's blocks; sliding-window layers will not free "
            "blocks out of their window (hybrid KV cache off)"
        )
        return False
    return True


def load_rank_model(config: Config, ctx: ParallelContext | None) -> CausalLM:
    """This rank's model: the same call on every rank, so every rank builds the same shard layout."""
    seed = config.model.seed if config.model.load_format == "random" else None
    return load_model(
        model_dir(config),
        config.model.dtype,
        torch_device(config),
        max_model_len=config.model.max_model_len,
        show_progress=False,
        parallel=ctx,
        random_weights_seed=seed,
        quantization=config.model.quantization,
    )


def fit_max_model_len(
    config: Config, model_max_len: int, num_blocks: int, groups: Sequence[KVCacheGroup] | None = None
) -> int:
    """The context limit: the model's, but never more than the KV cache holds (a lone sequence must fit). When
    every layer slides (one group with a window), a sequence holds at most its window and a prefill chunk of
    blocks (it hands back older ones: kv_cache_manager.py), so any length fits where that does; with a hybrid
    cache, its sliding groups hold that much and the full groups the whole context (kv_cache_groups.py)."""
    block_size = config.cache.block_size
    chunk = config.scheduler.max_num_batched_tokens
    window = groups[0].window if groups and not is_hybrid(groups) else None
    if window is not None and -(-(window + chunk) // block_size) + 2 <= num_blocks:
        return config.model.max_model_len or model_max_len
    capacity = max_context(groups, num_blocks, block_size, chunk) if groups else num_blocks * block_size
    if config.model.max_model_len is not None and config.model.max_model_len > capacity:
        raise ValueError(
            f"max_model_len: {config.model.max_model_len} exceeds the KV cache ({num_blocks} blocks of "
            f"{config.cache.block_size} = {capacity} tokens)"
        )
    if model_max_len > capacity:
        log.warning("max_model_len lowered from %d to %d: the KV cache holds no more", model_max_len, capacity)
    return min(model_max_len, capacity)


def select_attention_backend(device: torch.device) -> None:
    name = attention.default_backend(device)
    try:
        attention.use_backend(name)
    except ImportError:
        log.warning("attention backend %r unavailable; using the torch reference", name)
        attention.use_backend("torch")


def refuse_unsupported_attention(model: CausalLM) -> None:
    """Fail at start, not at the first step, when the model needs attention features the backend lacks."""
    needs = getattr(model, "needs_torch_attention", None)
    if needs is not None and attention.backend_name() != "torch":
        raise ValueError(
            f"{model.spec.architecture} needs {needs}, which the {attention.backend_name()} backend "
            "does not have yet; use --device cpu / the torch backend"
        )


@torch.inference_mode()
def follow_step(runner: ModelRunner, ctx: ParallelContext, message: StepMessage) -> None:
    """Run rank 0's step on this rank's shard: the same inputs, the same collectives, no sampling."""
    batch = message.batch
    assert batch is not None
    if runner.buffers is None:
        inputs = to_model_input(batch, runner.device, runner.layer_groups)
    else:
        inputs = runner.buffers.load(batch)
    if batch.patch_rows.shape[0] > 0:
        ctx.broadcast_from_driver(inputs.input_ids)  # rank 0's ids with the placeholders filled in
    if message.graph_id is not None:
        assert runner.graphs is not None
        hidden = runner.graphs.replay(message.graph_id)
    else:
        with partial_sums.forward_pass():  # as rank 0's runner does: the same kernels on every rank
            hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
    if batch.logits_rows.shape[0] > 0:
        runner.model.compute_logits(hidden[inputs.logits_rows])  # joins the logits all-gather


def follow_steps(runner: ModelRunner, ctx: ParallelContext) -> None:
    """Follow rank 0's steps until its stop message."""
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
    config = Config.from_dict(json.loads(args.config))
    ctx = init_parallel(
        args.rank,
        args.world_size,
        args.init_method,
        torch_device(config),
        config.parallel.parallel_timeout_s,
        *all_reduce_limits(config.parallel),
    )
    runner = Worker(config, ctx).build_runner()
    if runner.device.type == "cuda" and config.runner.warm_up:
        runner.capture_graphs()
    log.info("rank %d ready", args.rank)
    follow_steps(runner, ctx)
    log.info("rank %d stopped", args.rank)
    shutdown_parallel()
    logging.shutdown()
    os._exit(0)  # skip interpreter teardown: CUDA/NCCL destructors have nothing left to do here


if __name__ == "__main__":
    main()
