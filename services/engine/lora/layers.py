"""LoRA on the fused projections: y = base(x) + (x @ A[slot]^T) @ B[slot]^T per token, slot -1 = no delta.

    (L = max_loras, R = max_rank)  slices     lora_a                 lora_b
    qkv_proj                       q | k | v  [L, 3 * R, hidden]     [L, q + k + v, R]
    o_proj                         one        [L, R, q_size]         [L, hidden, R]
    gate_up_proj                   gate | up  [L, 2 * R, hidden]     [L, 2 * inter, R]
    down_proj                      one        [L, R, inter]          [L, hidden, R]

Slice i's A rows are i*max_rank .. i*max_rank + r (an adapter of rank r < max_rank leaves zeros), its B
rows are the slice's output columns; B holds the adapter's scaling already. On CUDA the Triton kernels
(kernels/lora.py) run, elsewhere the torch reference; a step that no token uses an adapter in skips them,
except a graph replay (captured graphs hold the kernels, which then return at once).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch
from torch import nn

from pagedserve.kernels import lora_reference


class LoRABatch:
    """The step's tokens grouped by slot (kernels/lora_reference.py draws it), in persistent tensors that
    captured graphs read in place; written before each forward."""

    def __init__(self, max_num_tokens: int, max_loras: int, device: torch.device) -> None:
        self.max_loras = max_loras
        self.sorted_token_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)  # [max_num_tokens]
        self.slot_starts = torch.zeros(max_loras + 1, dtype=torch.int32, device=device)  # [max_loras + 1]
        self.is_cuda = device.type == "cuda"
        self.has_lora_tokens = False
        self.is_graph = self.is_cuda  # until the first step: what the start-up forwards and graph captures see
        self.ops: ModuleType = lora_reference
        if self.is_cuda:
            from pagedserve.kernels import lora  # triton: CUDA machines only

            self.ops = lora

    @property
    def applies(self) -> bool:
        """Whether the layers run the LoRA kernels this step: some token uses an adapter, or a graph replays."""
        return self.is_graph or self.has_lora_tokens

    def prepare(self, token_slots: np.ndarray, is_graph: bool = False) -> None:  # [num_tokens] int64, -1 = base
        lora_rows = np.flatnonzero(token_slots >= 0)
        slots = token_slots[lora_rows]
        order = lora_rows[np.argsort(slots, kind="stable")].astype(np.int32)
        starts = np.zeros(self.max_loras + 1, dtype=np.int32)
        np.cumsum(np.bincount(slots, minlength=self.max_loras), out=starts[1:])
        self.has_lora_tokens = bool(order.size)
        self.is_graph = is_graph
        self.slot_starts.copy_(torch.from_numpy(starts), non_blocking=True)
        if order.size:
            self.sorted_token_ids[: order.size].copy_(torch.from_numpy(order), non_blocking=True)


class LoRALinear(nn.Module):
    """A projection with adapter slots beside it; `slices` are its stacked outputs (offset, width)."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        slices: list[tuple[int, int]],
        max_loras: int,
        max_rank: int,
        batch: LoRABatch,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base, self.batch, self.slices, self.max_rank = base, batch, slices, max_rank
        self.in_features = in_features
        self.out_features = sum(width for _, width in slices)
        self.lora_a = torch.zeros(max_loras, len(slices) * max_rank, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, self.out_features, max_rank, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in_features]
        y: torch.Tensor = self.base(x)
        batch = self.batch
        if not batch.applies:
            return y
        rank, ops = self.max_rank, batch.ops
        shrunk = torch.empty(x.shape[0], len(self.slices) * rank, dtype=torch.float32, device=x.device)
        ops.lora_shrink(x, self.lora_a, shrunk, batch.sorted_token_ids, batch.slot_starts)
        for i, (offset, width) in enumerate(self.slices):
            ops.lora_expand(
                shrunk[:, i * rank : (i + 1) * rank],
                self.lora_b[:, offset : offset + width],
                y[:, offset : offset + width],
                batch.sorted_token_ids,
                batch.slot_starts,
            )
        return y

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def load_slice(self, slot: int, index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slice `index` of an adapter: a [r, in_features], b [width, r] (scaled)."""
        offset, width = self.slices[index]
        rank = a.shape[0]
        if a.shape != (rank, self.in_features) or b.shape != (width, rank):
            raise ValueError(
                f"LoRA weights of shapes {list(a.shape)} / {list(b.shape)} do not fit a projection of "
                f"{self.in_features} -> {width} features"
            )
        start = index * self.max_rank
        self.lora_a[slot, start : start + rank].copy_(a)
        self.lora_b[slot, offset : offset + width, :rank].copy_(b)
