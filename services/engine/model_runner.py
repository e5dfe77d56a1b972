"""Runs one scheduled step on the device: inputs -> forward -> logits of sampling rows -> sampler.

Owns the per-layer paged KV caches (`[2, num_blocks, block_size, num_kv_heads, head_dim]`, shapes
from `model.spec`), the sampler and, on CUDA, the persistent input buffers and the decode graphs.

`launch` enqueues a whole step without waiting for the GPU and returns a `StepHandle`; the step's
results (sampled ids, logprobs) reach the host in one asynchronous copy, and `StepHandle.result()`
is the step's one host sync. The sampled ids stay on the device too: the next step, launched before
this one's results are read, takes its placeholder tokens from them (`pending_rows`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.services.engine import attention, pooler, prompt_logprobs
from pagedserve.services.engine.attention import AttentionMetadata
from pagedserve.services.engine.config import kv_cache_torch_dtype, torch_device
from pagedserve.services.engine.cuda_graphs import StepGraphs, graph_shapes
from pagedserve.services.engine.input_batch import (
    BlockTableRows,
    InputBuffers,
    build_host_batch,
    eager_token_bucket,
    pad_eager_batch,
    to_model_input,
)
from pagedserve.services.engine.kv_cache_groups import KVCacheGroup, layer_groups, layer_slots, num_cache_tensors
from pagedserve.services.engine.kv_offload import HostKVCaches, KVTransfers, num_host_slots
from pagedserve.services.engine.lora.manager import LoRAManager
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.models.int4 import largest_dequantized_bytes
from pagedserve.services.engine.outputs import TokenLogprob
from pagedserve.services.engine.parallel import partial_sums
from pagedserve.services.engine.parallel.step_broadcast import StepSender
from pagedserve.services.engine.request import Request
from pagedserve.services.engine.sampler import Sampler, SamplerOutput
from pagedserve.services.engine.sampling_metadata import SamplingMetadataCache
from pagedserve.services.engine.scheduler import ScheduledRequest
from pagedserve.services.engine.spec_decode.verify import VerifiedTokens, verify
from pagedserve.services.engine.step_profile import GpuMarks, StepProfile
from pagedserve.services.engine.structured.bitmask import TokenBitmask
from pagedserve.shared.config import Config

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepResult:
    sampled_token_ids: list[int]  # one per sampling sequence, in schedule order
    logprobs: list[TokenLogprob | None]  # likewise; None where not asked for
    prompt_logprobs: list[prompt_logprobs.PromptLogprobs] = field(default_factory=list)  # requests that asked
    pooled: list[tuple[Request, list[float]]] = field(default_factory=list)  # pooling requests whose prompt ended


@dataclass(slots=True)
class StepHandle:
    """A launched step. `sampled_token_ids` [num_sampling] int64 lives on the device."""

    kind: str  # "graph" (a captured decode graph) | "eager"
    num_tokens: int
    sampled_token_ids: torch.Tensor | None
    packed: torch.Tensor | None  # float64 host copy: sampled ids, then logprob ids and values
    ready: torch.cuda.Event | None  # recorded after the copy to the host (None: already there)
    num_logprobs: list[int | None]  # per sampling row, the request's logprobs setting
    logprob_width: int  # columns of the logprob block (0 when none was asked)
    marks: GpuMarks | None = None
    prompt_chunks: list[prompt_logprobs.PromptLogprobChunk] = field(default_factory=list)  # device tensors
    pooled_chunks: list[pooler.PooledChunk] = field(default_factory=list)  # device tensors
    verified: VerifiedTokens | None = None  # a verify step's tokens (speculative decoding; on the host already)

    def result(self) -> StepResult:
        """Wait for the step (the one host sync) and unpack its results."""
        if self.ready is not None:
            self.ready.synchronize()
        result = (
            StepResult([], []) if self.packed is None else _unpack(self.packed, self.num_logprobs, self.logprob_width)
        )
        if self.prompt_chunks:  # only requests that asked for prompt logprobs pay this copy
            result.prompt_logprobs = prompt_logprobs.to_host(self.prompt_chunks)
        if self.pooled_chunks:  # likewise only pooling requests
            result.pooled = pooler.to_host(self.pooled_chunks)
        return result


class ModelRunner:
    @classmethod
    def from_config(
        cls,
        model: CausalLM,
        config: Config,
        num_blocks: int,
        max_model_len: int,
        *,
        profile: StepProfile | None = None,
        step_sender: StepSender | None = None,
        lora: LoRAManager | None = None,
        kv_groups: Sequence[KVCacheGroup] = (),
    ) -> ModelRunner:
        """The runner an engine (or a tensor-parallel rank) builds: one construction path for both."""
        return cls(
            model,
            num_blocks,
            config.cache.block_size,
            torch_device(config),
            config.model.seed,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=max_model_len,
            cuda_graph_max_batch=config.runner.num_graph_batch,
            cuda_graph_max_tokens=config.runner.num_graph_tokens,
            profile=profile,
            kv_cache_dtype=kv_cache_torch_dtype(config),
            step_sender=step_sender,
            lora=lora,
            kv_offload_gb=config.cache.kv_offload_gb if config.cache.enable_prefix_caching else 0.0,
            kv_groups=kv_groups,
        )

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        seed: int,
        *,
        max_num_seqs: int = 256,
        max_num_tokens: int = 2048,
        max_model_len: int | None = None,
        cuda_graph_max_batch: int = 0,  # decode steps of up to this many sequences replay graphs (0: none)
        cuda_graph_max_tokens: int = 0,  # mixed/prefill steps of up to this many tokens replay graphs (0: none)
        profile: StepProfile | None = None,
        kv_cache_dtype: torch.dtype | None = None,  # None: the model's dtype; float8_e4m3fn: fp8 cache
        step_sender: StepSender | None = None,  # tensor parallel: rank 0 sends each step to the others
        lora: LoRAManager | None = None,  # adapters wrapped around the model's projections (--enable-lora)
        kv_offload_gb: float = 0.0,  # host memory for evicted prefix blocks (kv_offload.py); 0: none
        kv_groups: Sequence[KVCacheGroup] = (),  # a hybrid KV cache's groups, sharing the `num_blocks` pool
    ) -> None:
        self.model = model
        self.spec = model.spec
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len = max_model_len or self.spec.max_model_len  # the served context limit
        self.kv_groups = list(kv_groups) or [KVCacheGroup(None, tuple(range(self.spec.num_layers)))]
        # Each layer's group (whose block tables it reads), with several groups; None: one group
        self.layer_groups = layer_groups(self.kv_groups, self.spec.num_layers) if len(self.kv_groups) > 1 else None
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, device, kv_cache_dtype, self.kv_groups)
        assert self.layer_groups is None or kv_offload_gb == 0, "no host KV tier with a hybrid KV cache"
        num_slots = num_host_slots(kv_offload_gb, self.kv_caches) if kv_offload_gb > 0 else 0
        self.host_kv = HostKVCaches(num_slots, self.kv_caches) if num_slots > 0 else None
        self.sampler = Sampler(device, seed)
        self.sampling_metadata = SamplingMetadataCache()
        self.table_rows = [BlockTableRows() for _ in self.kv_groups]  # block tables updated by what changed
        self.profile = profile or StepProfile()
        self.step_sender = step_sender
        self.lora = lora
        self.buffers: InputBuffers | None = None
        self.graphs: StepGraphs | None = None
        # EAGLE-3: takes the step's aux hidden states (model.aux_hidden_layers), rows in schedule order
        self.on_aux_hidden: Callable[[Sequence[ScheduledRequest], list[torch.Tensor]], None] | None = None
        if device.type == "cuda":
            self.buffers = InputBuffers(
                max(max_num_tokens, max_num_seqs),
                max_num_seqs,
                -(-max_model_len // block_size),
                device,
                self.layer_groups or (),
            )
            # Graphs need kernels that read no host-side lengths: the Triton backend's.
            shapes = graph_shapes(
                min(cuda_graph_max_batch, max_num_seqs), min(cuda_graph_max_tokens, max_num_tokens), max_num_seqs
            )
            if shapes and attention.backend_name() == "triton":
                lora_batch = lora.batch if lora is not None else None
                self.graphs = StepGraphs(model, self.kv_caches, self.buffers, shapes, max_model_len, lora_batch)

    def capture_graphs(self) -> None:
        """CUDA start-up (every rank, in step): capture the step graphs, then load the logits GEMM's kernels."""
        if self.graphs is not None:
            self.graphs.capture()
        self._warm_logits()

    @torch.inference_mode()
    def _warm_logits(self) -> None:
        """Run the logits GEMM once for every number of sampling rows a step can have. cuBLAS picks its kernel by
        row count, and CUDA loads a kernel lazily, at its first launch, waiting for the device to go idle: met
        under load, each new row count held the host until the step running on the GPU ended. A first burst's
        prefill steps (16, 31, 47, ... rows) so lost their overlap with the host (H200, SmolLM2 shape: the host
        waited out each 6-9 ms forward; 1.05 s for a burst that took 0.90 s when run again)."""
        if self.buffers is None or self.device.type != "cuda":  # (CPU tests build CUDA's buffers and graphs)
            return
        max_rows = self.buffers.max_num_seqs
        hidden = torch.zeros(max_rows, self.spec.hidden_size, dtype=self.spec.dtype, device=self.device)
        for rows in range(1, max_rows + 1):
            self.model.compute_logits(hidden[:rows]).argmax(dim=-1)
        torch.cuda.synchronize(self.device)

    def execute(
        self,
        scheduled: Sequence[ScheduledRequest],
        block_tables: Sequence[Sequence[int]],
        group_tables: Sequence[Sequence[Sequence[int]]] = (),
    ) -> StepResult:
        """Run a step and wait for its results."""
        return self.launch(scheduled, block_tables, group_tables=group_tables).result()

    @torch.inference_mode()
    def launch(
        self,
        scheduled: Sequence[ScheduledRequest],
        block_tables: Sequence[Sequence[int]],
        pending_rows: Mapping[Request, int] | None = None,  # placeholder last token -> row in previous
        previous: StepHandle | None = None,  # the step whose sampled ids fill those placeholders
        grammar_masks: Callable[[], TokenBitmask | None] | None = None,  # called once the forward is enqueued
        kv_transfers: KVTransfers | None = None,  # host-tier copies to run before the forward pass
        group_tables: Sequence[Sequence[Sequence[int]]] = (),  # per sliding group, its block tables (hybrid)
    ) -> StepHandle:
        """Enqueue the step's copies, forward pass, sampling and result copy; no host sync."""
        profile = self.profile
        if kv_transfers and self.host_kv is not None:
            self.host_kv.apply(kv_transfers)
        assert len(group_tables) == len(self.kv_groups) - 1, "block tables for every group"
        batch = build_host_batch(scheduled, block_tables, self.block_size, pending_rows, group_tables, self.table_rows)
        num_tokens = batch.num_tokens
        graph_id = self.graphs.choose(batch) if self.graphs else None
        if graph_id is not None and self.graphs is not None:
            batch = self.graphs.pad(batch, graph_id)
        elif self.buffers is not None and attention.backend_name() == "triton":
            batch = pad_eager_batch(batch, min(eager_token_bucket(num_tokens), self.buffers.max_num_tokens))
        if self.step_sender is not None:
            self.step_sender.send(batch, graph_id)
        # Each token's adapter slot, in the buffers the LoRA layers (and graphs) read; with none, the base model only.
        uses_lora = self.lora is not None and self.lora.prepare(scheduled, batch.num_tokens)
        if self.buffers is None:
            inputs = to_model_input(batch, self.device, self.layer_groups)
        else:
            inputs = self.buffers.load(batch)
        marks = GpuMarks.create() if profile.enabled and self.device.type == "cuda" else None
        if marks is not None:
            marks.start.record()
        if inputs.patch_rows is not None and inputs.patch_src is not None:
            assert previous is not None and previous.sampled_token_ids is not None
            inputs.input_ids.index_copy_(0, inputs.patch_rows, previous.sampled_token_ids[inputs.patch_src])
            if self.step_sender is not None:
                self.step_sender.share_input_ids(inputs.input_ids)
        profile.mark("prepare")

        if graph_id is not None and self.graphs is not None:
            hidden = self.graphs.replay(graph_id, uses_lora)  # [the graph's num_tokens, hidden]
        else:
            with partial_sums.forward_pass():
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if self.on_aux_hidden is not None:
            self.on_aux_hidden(scheduled, self.model.aux_hidden_states)
        prompt_chunks = (
            prompt_logprobs.compute_chunks(self.model, hidden, scheduled)
            if prompt_logprobs.wants_prompt_logprobs(scheduled)
            else []
        )
        pooled_chunks = pooler.pool_step(hidden, scheduled) if pooler.wants_pooling(scheduled) else []
        sampling_requests = [s.request for s in scheduled if s.is_sampling]
        kind = "eager" if graph_id is None else "graph"
        if not sampling_requests:
            if marks is not None:
                marks.forward_done.record()
                marks.sample_done.record()
            profile.mark("forward")
            event = _record_event(self.device)
            return StepHandle(kind, num_tokens, None, None, event, [], 0, marks, prompt_chunks, pooled_chunks)
        logits = self.model.compute_logits(hidden[inputs.logits_rows])  # [num_sampling, vocab] fp32
        if marks is not None:
            marks.forward_done.record()
        profile.mark("forward")

        # The grammar rows' masks, filled on a worker thread while this step was prepared and launched.
        token_bitmask = grammar_masks() if grammar_masks is not None else None
        drafts = [s.spec_token_ids for s in scheduled if s.is_sampling]
        if any(drafts):  # speculative decoding: logits at every draft position (spec_decode/verify.py)
            verified = verify(self.sampler, logits, sampling_requests, drafts, self.spec.vocab_size)
            if marks is not None:
                marks.sample_done.record()
            profile.mark("sample")
            return StepHandle(kind, num_tokens, None, None, None, [], 0, marks, prompt_chunks, pooled_chunks, verified)
        meta = self.sampling_metadata.get(sampling_requests, self.spec.vocab_size, self.device)
        output = self.sampler(logits, meta, token_bitmask)
        num_logprobs = [r.params.logprobs for r in sampling_requests]
        packed = _pack(output)
        width = 0 if output.logprobs is None else output.logprobs.shape[1]
        if self.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            packed = host
        if marks is not None:
            marks.sample_done.record()
        handle = StepHandle(
            kind,
            num_tokens,
            output.sampled_token_ids,
            packed,
            _record_event(self.device),
            num_logprobs,
            width,
            marks,
            prompt_chunks,
            pooled_chunks,
        )
        profile.mark("sample")
        return handle


def _record_event(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _pack(output: SamplerOutput) -> torch.Tensor:
    tensors = [output.sampled_token_ids.double()]
    if output.logprobs is not None and output.logprob_token_ids is not None:
        tensors += [output.logprob_token_ids.double().flatten(), output.logprobs.double().flatten()]
    return torch.cat(tensors)


def _unpack(host: torch.Tensor, num_logprobs: list[int | None], width: int) -> StepResult:
    packed = host.numpy()
    num_rows = len(num_logprobs)
    sampled: list[int] = packed[:num_rows].astype(np.int64).tolist()
    logprobs: list[TokenLogprob | None] = [None] * num_rows
    if width:
        rest = packed[num_rows:].tolist()
        num_entries = len(rest) // 2
        ids, values = rest[:num_entries], rest[num_entries:]
        lp_rows = (row for row, k in enumerate(num_logprobs) if k is not None)
        for i, row in enumerate(lp_rows):
            k = num_logprobs[row] or 0
            base = i * width
            top = [(int(ids[base + 1 + j]), values[base + 1 + j]) for j in range(k)]
            logprobs[row] = TokenLogprob(int(ids[base]), values[base], top)
    return StepResult(sampled, logprobs)


def allocate_kv_caches(
    model: CausalLM,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype | None = None,
    groups: Sequence[KVCacheGroup] = (),  # a hybrid KV cache: layer j of every group shares cache tensor j
) -> list[torch.Tensor]:
    """Each layer's cache tensor; with several groups, layers at the same position in their groups share one
    (they never hold the same block: kv_cache_groups.py)."""
    spec = model.spec
    shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    if len(groups) <= 1:
        return [torch.zeros(shape, dtype=dtype or spec.dtype, device=device) for _ in range(spec.num_layers)]
    tensors = [torch.zeros(shape, dtype=dtype or spec.dtype, device=device) for _ in range(num_cache_tensors(groups))]
    return [tensors[slot] for slot in layer_slots(groups, spec.num_layers)]


def num_kv_blocks_for(model: CausalLM, config: Config, max_model_len: int, groups: Sequence[KVCacheGroup] = ()) -> int:
    """KV blocks to allocate (with a hybrid KV cache, a block spans one group's layers: kv_cache_groups.py): the
    configured count, a fixed budget on CPU, or what fits on the GPU."""
    if config.cache.num_kv_blocks is not None:
        return config.cache.num_kv_blocks
    spec = model.spec
    bytes_per_block = spec.kv_bytes_per_token(kv_cache_torch_dtype(config)) * config.cache.block_size
    if len(groups) > 1:  # one block: a block of each cache tensor
        bytes_per_block = bytes_per_block // spec.num_layers * num_cache_tensors(groups)
    if torch_device(config).type != "cuda":
        return max(1, config.cache.cpu_kv_cache_bytes // bytes_per_block)
    budget = _cuda_kv_budget_bytes(model, config, max_model_len)
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise RuntimeError(
            f"no GPU memory left for the KV cache (budget {budget} bytes); "
            "raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return num_blocks


@torch.inference_mode()
def _cuda_kv_budget_bytes(model: CausalLM, config: Config, max_model_len: int) -> int:
    """Run the largest step once with throwaway caches and measure the activation peak."""
    device, block_size = torch_device(config), config.cache.block_size
    num_tokens = min(config.scheduler.max_num_batched_tokens, max_model_len * config.scheduler.max_num_seqs)
    seq_len = min(num_tokens, max_model_len)
    num_seqs = -(-num_tokens // seq_len)
    blocks_per_seq = -(-seq_len // block_size)
    caches = allocate_kv_caches(model, num_seqs * blocks_per_seq, block_size, device, kv_cache_torch_dtype(config))
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    lens = [min(seq_len, num_tokens - i * seq_len) for i in range(num_seqs)]
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    tables = torch.arange(num_seqs * blocks_per_seq, device=device, dtype=torch.int32).view(num_seqs, -1)
    slots = torch.cat(
        [
            tables[i, torch.arange(n, device=device) // block_size].long() * block_size
            + torch.arange(n, device=device) % block_size
            for i, n in enumerate(lens)
        ]
    )
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slots, starts, torch.tensor(lens, dtype=torch.int32, device=device), tables, max(lens), max(lens)
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    hidden = model(input_ids, positions, caches, meta)
    num_rows = min(config.scheduler.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[:num_rows])
    sorted_logits = logits.sort(dim=-1, descending=True).values.softmax(dim=-1).cumsum(dim=-1)  # top_p's peak
    del hidden, logits, sorted_logits
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - baseline
    del caches
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used = total - free  # weights, the CUDA context, other processes
    # The mixed graphs' shared pool holds about the largest one's activations, beside the eager steps' own, and
    # a whole dequantised 4-bit weight (not proportional to tokens) when a graph's step dequantises one.
    graph_pool = activation_peak * min(config.runner.num_graph_tokens, num_tokens) // num_tokens
    graph_pool += largest_dequantized_bytes(model)
    budget = int(total * config.cache.gpu_memory_utilization) - used - activation_peak - graph_pool
    log.info(
        "KV cache budget %.2f GiB (used %.2f, activation peak %.2f, mixed-step graphs %.2f)",
        budget / 2**30,
        used / 2**30,
        activation_peak / 2**30,
        graph_pool / 2**30,
    )
    return budget
