"""CUDA graphs of the decode forward pass: one per batch size, captured at start-up.

A decode-only step of n sequences replays the graph of the smallest captured size >= n, its batch
padded with one-token sequences that write no K/V (see `input_batch.pad_decode_batch`). The graphs
read their inputs from `InputBuffers`' persistent tensors, and capture what the kernels need fixed
(kernels/launch_config.py): num_tokens = num_seqs = size, full-width block tables, decode-only.
Graphs hold the forward pass up to the final norm; logits of the sampling rows and the sampler run
eagerly (a [size, vocab] fp32 output per graph would cost gigabytes over all sizes).

Sizes: 1, 2, 4, then every multiple of 8 up to the largest (as vLLM). Larger sizes are captured
first, and all graphs share one memory pool, so the pool is about the largest graph's activations.
"""

from __future__ import annotations

import logging
import time

import torch

from pagedserve.services.engine.attention import AttentionMetadata
from pagedserve.services.engine.input_batch import InputBuffers
from pagedserve.services.engine.models.base import CausalLM

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return [*sizes, max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        buffers: InputBuffers,
        sizes: list[int],
        max_model_len: int,
    ) -> None:
        assert sizes and max(sizes) <= buffers.max_num_seqs
        self.model, self.kv_caches, self.buffers = model, kv_caches, buffers
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # size -> graph, hidden out

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, num_seqs: int, max_query_len: int) -> int | None:
        """The captured size to run a step with, or None to run it eagerly."""
        if max_query_len != 1 or num_seqs > self.max_size or not self._graphs:
            return None
        return next(s for s in self.sizes if s >= num_seqs)

    def replay(self, size: int) -> torch.Tensor:  # [size, hidden_size], valid until the next replay
        graph, hidden = self._graphs[size]
        graph.replay()
        return hidden

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self._fill_dummy_decode(self.max_size)
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # eager first: compiles this size's kernels outside the capture
            torch.cuda.synchronize(self.buffers.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(size)
            pool = graph.pool()
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize(self.buffers.device)
        log.info(
            "captured %d decode CUDA graphs (batch 1..%d) in %.1f s",
            len(self.sizes),
            self.max_size,
            time.perf_counter() - start,
        )

    def _forward(self, size: int) -> torch.Tensor:
        ids = self.buffers.device_1d
        meta = AttentionMetadata(
            slot_mapping=ids["slot_mapping"][:size],
            query_start_loc=ids["query_start_loc"][: size + 1],
            seq_lens=ids["seq_lens"][:size],
            block_tables=self.buffers.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # read by no CUDA kernel: a graph serves every length
        )
        meta.with_groups([g.for_graph(size) for g in self.buffers.groups], self.buffers.layer_groups)
        return self.model(ids["input_ids"][:size], ids["positions"][:size], self.kv_caches, meta)

    def _fill_dummy_decode(self, size: int) -> None:
        """One-token sequences at position 0 that write nothing (slot -1) and read one cached key."""
        ids = self.buffers.device_1d
        ids["input_ids"][:size].zero_()
        ids["positions"][:size].zero_()
        ids["slot_mapping"][:size].fill_(-1)
        for group in self.buffers.groups:
            group.slot_mapping[:size].fill_(-1)
        ids["query_start_loc"][: size + 1].copy_(torch.arange(size + 1, dtype=torch.int32))
        ids["seq_lens"][:size].fill_(1)
