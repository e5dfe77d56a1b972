"""CUDA graphs of the forward pass, captured at start-up: decode steps and mixed/prefill steps.

An eager step launches every kernel of every layer from Python (~300 launches for a 30-layer model,
20-90 µs of host time each), so a short prefill of a small model waited on the host, not the GPU.
A step that fits a captured shape replays its graph instead, its batch padded to that shape:

    decode  (n, n)        n one-token sequences; padding sequences read one key and write nothing
                          (`input_batch.pad_decode_batch`). Sizes 1, 2, 4, then every multiple of 8.
    mixed   (T, S, kind)  T tokens over S sequences, some with more than one new token: prefill
                          chunks, prompts beside decodes, drafts to verify. Padding tokens belong to
                          no sequence and padding sequences have no tokens (`pad_mixed_batch`):
                          the attention kernels' programs for them exit at once.

What a graph fixes is what the kernels take from host integers (kernels/launch_config.py): the token
and sequence counts (grids), whether the batch is decode-only, and the max_query_len bucket (`kind`:
the paged kernel's tiles, and whether the prefill kernel may take the step). A mixed T gets two
sequence counts: min(T, max_num_seqs), which any batch of T tokens fits, and T // 32, the most the
prefill kernel takes (`uses_prefill_kernel`), so a long prompt keeps that faster kernel.

Graphs hold the forward pass up to the final norm; logits of the sampling rows and the sampler run
eagerly (a [T, vocab] fp32 output per graph would cost gigabytes over all shapes). Larger graphs are
captured first and all share one memory pool, so the pool is about the largest graph's activations.
A graph is named by its index in `shapes` (the same list on every tensor-parallel rank).

With LoRA on, each shape has two graphs: the base one, captured with the LoRA layers bypassed, which steps
without an adapter token replay (they cost what a base step costs), and a LoRA one holding the shrink/expand
kernels. The LoRA variant ends by copying its hidden states into the base variant's output, so the pool holds
one set of static outputs, not two: the extra memory is the graphs themselves; capture takes twice as long.
"""

from __future__ import annotations

import bisect
import enum
import logging
import time
from dataclasses import dataclass

import torch

from pagedserve.kernels.launch_config import PREFILL_KERNEL_MIN_MEAN_QUERY_LEN, PREFILL_QUERY_LEN
from pagedserve.services.engine.attention import AttentionMetadata
from pagedserve.services.engine.input_batch import HostBatch, InputBuffers, pad_decode_batch, pad_mixed_batch
from pagedserve.services.engine.lora.layers import LoRABatch
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.parallel import partial_sums

log = logging.getLogger(__name__)


class QueryKind(enum.IntEnum):
    DECODE = 0  # every sequence has one new token
    SHORT = 1  # the longest query has 2 .. PREFILL_QUERY_LEN - 1 tokens (drafts, small chunks)
    LONG = 2  # some query has PREFILL_QUERY_LEN tokens or more (prompts)

    @classmethod
    def of(cls, max_query_len: int) -> QueryKind:
        return cls.DECODE if max_query_len <= 1 else cls.SHORT if max_query_len < PREFILL_QUERY_LEN else cls.LONG

    @property
    def max_query_len(self) -> int:
        """What the capture tells the kernels' config choice: any value of the bucket picks the same."""
        return (1, 2, PREFILL_QUERY_LEN)[self]


@dataclass(frozen=True, order=True, slots=True)
class GraphShape:
    num_tokens: int
    num_seqs: int
    kind: QueryKind


def capture_sizes(max_batch: int) -> list[int]:
    """Decode batch sizes: 1, 2, 4, then every multiple of 8 up to the largest (as vLLM)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return [*sizes, max_batch]


def mixed_token_sizes(max_tokens: int) -> list[int]:
    """Token counts of the mixed graphs: every 16 up to 128, then steps of a quarter of the power of two
    below (at most 25% padding; 24 sizes up to 2,048)."""
    sizes = [16, 32, 48, 64]
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] + (1 << (sizes[-1].bit_length() - 1)) // 4)
    return [s for s in sizes if s < max_tokens] + [max_tokens] if max_tokens >= 16 else []


def graph_shapes(max_decode_batch: int, max_mixed_tokens: int, max_num_seqs: int) -> list[GraphShape]:
    """Every shape to capture: decode graphs up to `max_decode_batch` sequences, mixed graphs up to
    `max_mixed_tokens` tokens (0: none)."""
    shapes = [GraphShape(n, n, QueryKind.DECODE) for n in capture_sizes(max_decode_batch)] if max_decode_batch else []
    for num_tokens in mixed_token_sizes(max_mixed_tokens) if max_mixed_tokens else []:
        any_seqs = min(num_tokens, max_num_seqs)
        shapes.append(GraphShape(num_tokens, any_seqs, QueryKind.SHORT))
        if num_tokens >= PREFILL_QUERY_LEN:
            shapes.append(GraphShape(num_tokens, any_seqs, QueryKind.LONG))
            prefill_seqs = num_tokens // PREFILL_KERNEL_MIN_MEAN_QUERY_LEN
            if prefill_seqs < any_seqs:
                shapes.append(GraphShape(num_tokens, prefill_seqs, QueryKind.LONG))
    return sorted(set(shapes))


class StepGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        buffers: InputBuffers,
        shapes: list[GraphShape],
        max_model_len: int,
        lora: LoRABatch | None = None,  # LoRA layers in the model: capture a LoRA variant of every shape too
    ) -> None:
        assert shapes and all(s.num_seqs <= buffers.max_num_seqs for s in shapes)
        assert all(s.num_tokens <= buffers.max_num_tokens for s in shapes)
        self.model, self.kv_caches, self.buffers = model, kv_caches, buffers
        self.shapes = sorted(shapes)
        self.max_model_len = max_model_len
        # per kind, its shapes' token counts (sorted) for the search in `choose`
        self._by_kind = {kind: [i for i, s in enumerate(self.shapes) if s.kind == kind] for kind in QueryKind}
        self._tokens_by_kind = {kind: [self.shapes[i].num_tokens for i in ids] for kind, ids in self._by_kind.items()}
        # shape index -> graph, hidden out, and the aux hidden states the model keeps (EAGLE-3; static outputs too)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, list[torch.Tensor]]] = {}
        self.lora = lora
        self._lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # shape index -> its LoRA variant (same outputs)

    def choose(self, batch: HostBatch) -> int | None:
        """The graph (an index of `shapes`) to run the step with: the fewest tokens, then the fewest
        sequences, of its kind that hold the batch; None to run it eagerly."""
        if not self._graphs:
            return None
        kind = QueryKind.of(batch.max_query_len)
        ids, tokens = self._by_kind[kind], self._tokens_by_kind[kind]
        num_tokens, num_seqs = batch.num_tokens, batch.num_seqs
        for position in range(bisect.bisect_left(tokens, num_tokens), len(ids)):
            if self.shapes[ids[position]].num_seqs >= num_seqs:
                return ids[position]
        return None

    def pad(self, batch: HostBatch, graph_id: int) -> HostBatch:
        shape = self.shapes[graph_id]
        if shape.kind == QueryKind.DECODE:
            return pad_decode_batch(batch, shape.num_seqs)
        return pad_mixed_batch(batch, shape.num_tokens, shape.num_seqs)

    def replay(self, graph_id: int, uses_lora: bool = False) -> torch.Tensor:
        """Run a graph (its LoRA variant when `uses_lora`: some token of the step uses an adapter); its hidden
        states [num_tokens, hidden_size], valid until the next replay."""
        graph, hidden, aux = self._graphs[graph_id]
        (self._lora_graphs[graph_id] if uses_lora else graph).replay()
        self.model.aux_hidden_states = aux
        return hidden

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = None
        # Largest first: the shared pool grows to the largest graph's needs once, the others fit in it.
        for graph_id in sorted(range(len(self.shapes)), key=lambda i: self.shapes[i], reverse=True):
            shape = self.shapes[graph_id]
            self._fill_dummy(shape)
            self._set_lora(True)
            self._forward(shape)  # eager first: compiles this shape's kernels (LoRA's too) outside the capture
            torch.cuda.synchronize(self.buffers.device)
            self._set_lora(False)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(shape)
            pool = graph.pool()
            aux = list(getattr(self.model, "aux_hidden_states", []))
            self._graphs[graph_id] = (graph, hidden, aux)
            if self.lora is not None:
                self._set_lora(True)
                self._lora_graphs[graph_id] = lora_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(lora_graph, pool=pool):
                    hidden.copy_(self._forward(shape))  # into the base variant's outputs
                    for out, lora_aux in zip(aux, getattr(self.model, "aux_hidden_states", []), strict=True):
                        out.copy_(lora_aux)
                self._set_lora(False)
        torch.cuda.synchronize(self.buffers.device)
        decode = [s.num_seqs for s in self.shapes if s.kind == QueryKind.DECODE]
        mixed = [s.num_tokens for s in self.shapes if s.kind != QueryKind.DECODE]
        log.info(
            "captured %d CUDA graphs (decode batch 1..%d, mixed steps %d..%d tokens) in %.1f s",
            len(self._graphs) + len(self._lora_graphs),
            max(decode, default=0),
            min(mixed, default=0),
            max(mixed, default=0),
            time.perf_counter() - start,
        )

    def _set_lora(self, applies: bool) -> None:
        """Whether the forward about to be captured runs the LoRA layers (no-op without LoRA)."""
        if self.lora is not None:
            self.lora.applies = applies
            self.lora.slot_starts.zero_()  # no adapter token: the kernels' programs return at once

    def _forward(self, shape: GraphShape) -> torch.Tensor:
        ids = self.buffers.device_1d
        num_tokens, num_seqs = shape.num_tokens, shape.num_seqs
        meta = AttentionMetadata(
            slot_mapping=ids["slot_mapping"][:num_tokens],
            query_start_loc=ids["query_start_loc"][: num_seqs + 1],
            seq_lens=ids["seq_lens"][:num_seqs],
            block_tables=self.buffers.block_tables[:num_seqs],
            max_query_len=shape.kind.max_query_len,
            max_seq_len=self.max_model_len,  # read by no CUDA kernel: a graph serves every length
        )
        meta.with_groups([g.for_graph(num_tokens, num_seqs) for g in self.buffers.groups], self.buffers.layer_groups)
        with partial_sums.forward_pass():  # captured: the graph ends ready for any forward after it
            return self.model(ids["input_ids"][:num_tokens], ids["positions"][:num_tokens], self.kv_caches, meta)

    def _fill_dummy(self, shape: GraphShape) -> None:
        """Inputs that write nothing (slot -1). Decode: one-token sequences at position 0 reading one cached
        key. Mixed: sequences with no tokens, so the attention programs exit (the grid is what is captured)."""
        ids = self.buffers.device_1d
        num_tokens, num_seqs = shape.num_tokens, shape.num_seqs
        ids["input_ids"][:num_tokens].zero_()
        ids["positions"][:num_tokens].zero_()
        ids["slot_mapping"][:num_tokens].fill_(-1)
        for group in self.buffers.groups:
            group.slot_mapping[:num_tokens].fill_(-1)
        if shape.kind == QueryKind.DECODE:
            ids["query_start_loc"][: num_seqs + 1].copy_(torch.arange(num_seqs + 1, dtype=torch.int32))
            ids["seq_lens"][:num_seqs].fill_(1)
        else:
            ids["query_start_loc"][: num_seqs + 1].zero_()
            ids["seq_lens"][:num_seqs].zero_()
