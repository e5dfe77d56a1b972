"""Runs one scheduled step on the device: inputs -> forward -> logits of sampling rows -> sampler.

Owns the per-layer paged KV caches (`[2, num_blocks, block_size, num_kv_heads, head_dim]`, shapes
from `model.spec`) and the sampler. Results reach the host in one transfer per step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.attention import AttentionMetadata
from services.engine.config import EngineConfig
from services.engine.input_batch import prepare_inputs
from services.engine.models.base import CausalLM
from services.engine.outputs import TokenLogprob
from services.engine.sampler import Sampler, SamplerOutput
from services.engine.sampling_metadata import build_sampling_metadata
from services.engine.scheduler import ScheduledRequest

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepResult:
    sampled_token_ids: list[int]  # one per sampling sequence, in schedule order
    logprobs: list[TokenLogprob | None]  # likewise; None where not asked for


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device, seed: int) -> None:
        self.model = model
        self.spec = model.spec
        self.device = device
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, device)
        self.sampler = Sampler(device, seed)

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledRequest], block_tables: Sequence[Sequence[int]]) -> StepResult:
        batch = prepare_inputs(scheduled, block_tables, self.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)  # [num_tokens, hidden]
        sampling_requests = [s.request for s in scheduled if s.is_sampling]
        if not sampling_requests:
            return StepResult([], [])
        logits = self.model.compute_logits(hidden[batch.logits_rows])  # [num_sampling, vocab]
        meta = build_sampling_metadata(sampling_requests, self.spec.vocab_size, self.device)
        output = self.sampler(logits, meta)
        return _to_host(output, [r.params.logprobs for r in sampling_requests])


def _to_host(output: SamplerOutput, num_logprobs: list[int | None]) -> StepResult:
    tensors = [output.sampled_token_ids.double()]
    if output.logprobs is not None and output.logprob_token_ids is not None:
        tensors += [output.logprob_token_ids.double().flatten(), output.logprobs.double().flatten()]
    host = torch.cat(tensors).cpu().tolist()  # the step's one device -> host sync
    num_rows = len(num_logprobs)
    sampled = [int(t) for t in host[:num_rows]]
    logprobs: list[TokenLogprob | None] = [None] * num_rows
    if output.logprobs is not None:
        width = output.logprobs.shape[1]
        num_entries = output.logprobs.numel()
        ids, values = host[num_rows : num_rows + num_entries], host[num_rows + num_entries :]
        lp_rows = (row for row, k in enumerate(num_logprobs) if k is not None)
        for i, row in enumerate(lp_rows):
            k = num_logprobs[row] or 0
            base = i * width
            top = [(int(ids[base + 1 + j]), values[base + 1 + j]) for j in range(k)]
            logprobs[row] = TokenLogprob(int(ids[base]), values[base], top)
    return StepResult(sampled, logprobs)


def allocate_kv_caches(
    model: CausalLM, num_blocks: int, block_size: int, device: torch.device
) -> list[torch.Tensor]:
    spec = model.spec
    shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]


def num_kv_blocks_for(model: CausalLM, config: EngineConfig, max_model_len: int) -> int:
    """KV blocks to allocate: the configured count, a fixed budget on CPU, or what fits on the GPU."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    bytes_per_block = model.spec.kv_bytes_per_token() * config.block_size
    if config.torch_device.type != "cuda":
        return max(1, config.cpu_kv_cache_bytes // bytes_per_block)
    budget = _cuda_kv_budget_bytes(model, config, max_model_len)
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise RuntimeError(f"no GPU memory left for the KV cache (budget {budget} bytes); "
                           "raise gpu_memory_utilization or lower max_num_batched_tokens")
    return num_blocks


@torch.inference_mode()
def _cuda_kv_budget_bytes(model: CausalLM, config: EngineConfig, max_model_len: int) -> int:
    """Run the largest step once with throwaway caches and measure the activation peak."""
    device, block_size = config.torch_device, config.block_size
    num_tokens = min(config.max_num_batched_tokens, max_model_len * config.max_num_seqs)
    seq_len = min(num_tokens, max_model_len)
    num_seqs = -(-num_tokens // seq_len)
    blocks_per_seq = -(-seq_len // block_size)
    caches = allocate_kv_caches(model, num_seqs * blocks_per_seq, block_size, device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    lens = [min(seq_len, num_tokens - i * seq_len) for i in range(num_seqs)]
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    tables = torch.arange(num_seqs * blocks_per_seq, device=device, dtype=torch.int32).view(num_seqs, -1)
    slots = torch.cat([tables[i, torch.arange(n, device=device) // block_size].long() * block_size
                       + torch.arange(n, device=device) % block_size for i, n in enumerate(lens)])
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    meta = AttentionMetadata(slots, starts, torch.tensor(lens, dtype=torch.int32, device=device), tables,
                             max(lens), max(lens))
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    hidden = model(input_ids, positions, caches, meta)
    num_rows = min(config.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[:num_rows])
    sorted_logits = logits.sort(dim=-1, descending=True).values.softmax(dim=-1).cumsum(dim=-1)  # top_p's peak
    del hidden, logits, sorted_logits
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - baseline
    del caches
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used = total - free  # weights, the CUDA context, other processes
    budget = int(total * config.gpu_memory_utilization) - used - activation_peak
    log.info("KV cache budget %.2f GiB (used %.2f, activation peak %.2f)", budget / 2**30, used / 2**30,
             activation_peak / 2**30)
    return budget
