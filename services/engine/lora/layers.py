"""LoRA on the fused projections: y = base(x) + (x @ A[slot]^T) @ B[slot]^T per token, slot -1 = no delta.

    (L = max_loras, R = max_rank)  slices     lora_a                 lora_b
    qkv_proj                       q | k | v  [L, 3 * R, hidden]     [L, q + k + v, R]
    o_proj                         one        [L, R, q_size]         [L, hidden, R]
    gate_up_proj                   gate | up  [L, 2 * R, hidden]     [L, 2 * inter, R]
    down_proj                      one        [L, R, inter]          [L, hidden, R]

Slice i's A rows are i*max_rank .. i*max_rank + r (an adapter of rank r < max_rank leaves zeros), its B
rows are the slice's output columns; B holds the adapter's scaling already. On CUDA the Triton kernels
(kernels/lora.py) run, elsewhere the torch reference: one shrink and one expand (every slice) per projection.

A step in which no token uses an adapter runs none of it (`LoRABatch.applies` is False): eagerly the layers
return the base output, and the graphs (cuda_graphs.py) replay their base variant, captured with LoRA off.

Decode-sized steps (<= SPLIT_K_MAX_TOKENS tokens) split the shrink's K and add partial sums into a zeroed
output; every projection then writes its own columns of one step-wide workspace, which the first projection
zeroes (one memset per step instead of one per projection). On CUDA their shrinks run on a side stream,
overlapping the base projection (also inside captured graphs: a fork and join per projection):

    workspace  [SPLIT_K_MAX_TOKENS, sum of slices * max_rank]  fp32
               | l0.qkv (3R) | l0.o (R) | l0.gate_up (2R) | l0.down (R) | l1.qkv | ...
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch
from torch import nn

from pagedserve.kernels import lora_reference


class LoRABatch:
    """The step's tokens grouped by slot (kernels/lora_reference.py draws it), in persistent tensors that
    captured graphs read in place; written before each forward that uses an adapter."""

    def __init__(
        self, max_num_tokens: int, max_loras: int, device: torch.device, ops: ModuleType | None = None
    ) -> None:
        self.max_loras = max_loras
        self.sorted_token_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)  # [max_num_tokens]
        self.slot_starts = torch.zeros(max_loras + 1, dtype=torch.int32, device=device)  # [max_loras + 1]
        self.device = device
        # Whether the layers run LoRA this forward: some token uses an adapter (`prepare`), or a graph capture's
        # LoRA variant. True until the first step: the start-up memory profile sees the LoRA activations.
        self.applies = device.type == "cuda"
        if ops is None:
            ops = lora_reference
            if device.type == "cuda":
                from pagedserve.kernels import lora  # triton: CUDA machines only

                ops = lora
        self.ops: ModuleType = ops
        self.num_workspace_rows = 0 if ops is lora_reference else min(max_num_tokens, ops.SPLIT_K_MAX_TOKENS)
        # Decode-sized steps run each shrink on this stream beside the base projection (both read only x), and
        # the expand after both: the small shrink's few µs hide under the weight-bound base GEMM.
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" and ops is not lora_reference else None
        self.num_workspace_columns = 0
        self.workspace: torch.Tensor | None = None  # [num_workspace_rows, num_workspace_columns] fp32

    def reserve_columns(self, num_columns: int) -> int:
        """A projection's columns of the workspace (before `allocate_workspace`); returns the first."""
        assert self.workspace is None
        start = self.num_workspace_columns
        self.num_workspace_columns += num_columns
        return start

    def allocate_workspace(self) -> None:
        """Once every projection reserved its columns, before any graph is captured (graphs read it in place)."""
        if self.num_workspace_rows:
            shape = (self.num_workspace_rows, self.num_workspace_columns)
            self.workspace = torch.zeros(shape, dtype=torch.float32, device=self.device)

    def prepare(self, token_slots: np.ndarray) -> None:  # [num_tokens] int64, -1 = base
        lora_rows = np.flatnonzero(token_slots >= 0)
        slots = token_slots[lora_rows]
        order = lora_rows[np.argsort(slots, kind="stable")].astype(np.int32)
        starts = np.zeros(self.max_loras + 1, dtype=np.int32)
        np.cumsum(np.bincount(slots, minlength=self.max_loras), out=starts[1:])
        self.applies = bool(order.size)
        self.slot_starts.copy_(torch.from_numpy(starts), non_blocking=True)
        if order.size:
            self.sorted_token_ids[: order.size].copy_(torch.from_numpy(order), non_blocking=True)

    def skip(self) -> None:
        """A step with no adapter token: the layers run the base projections only (the tensors stay stale)."""
        self.applies = False


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
        self.slice_ends = tuple(offset + width for offset, width in slices)
        assert [offset for offset, _ in slices] == [0, *self.slice_ends[:-1]], "slices stack their outputs in order"
        self.lora_a = torch.zeros(max_loras, len(slices) * max_rank, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, self.out_features, max_rank, dtype=dtype, device=device)
        self.workspace_start = batch.reserve_columns(len(slices) * max_rank)
        self.zeroes_workspace = self.workspace_start == 0  # the first projection a forward runs (layer 0's qkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in_features]
        batch = self.batch
        if not batch.applies:
            base: torch.Tensor = self.base(x)
            return base
        num_tokens, num_columns = x.shape[0], len(self.slices) * self.max_rank
        workspace = batch.workspace
        is_zeroed = workspace is not None and num_tokens <= workspace.shape[0]
        if workspace is not None and is_zeroed:
            if self.zeroes_workspace:
                workspace[:num_tokens].zero_()
            shrunk = workspace[:num_tokens, self.workspace_start : self.workspace_start + num_columns]
        else:
            shrunk = torch.empty(num_tokens, num_columns, dtype=torch.float32, device=x.device)
        ops, side = batch.ops, batch.side_stream
        if side is not None and is_zeroed:  # fork after the workspace's zeroing, join before the expand
            main = torch.cuda.current_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                ops.lora_shrink(x, self.lora_a, shrunk, batch.sorted_token_ids, batch.slot_starts, is_zeroed)
            y: torch.Tensor = self.base(x)
            main.wait_stream(side)
        else:
            y = self.base(x)
            ops.lora_shrink(x, self.lora_a, shrunk, batch.sorted_token_ids, batch.slot_starts, is_zeroed)
        ops.lora_expand(shrunk, self.lora_b, y, batch.sorted_token_ids, batch.slot_starts, self.slice_ends)
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
