"""Rank 0 -> the other ranks: each step's host batch as one packed int64 tensor (gloo, host memory).

    header  [HEADER_LEN] int64: kind, num_tokens, num_seqs, num_table_rows, num_table_cols,
            num_logits_rows, num_patches, max_query_len, max_seq_len,
            graph_id (an index of the captured graph shapes; -1: eager), num_groups
    payload [sum of the sizes] int64: input_ids | positions | slot_mapping | query_start_loc |
            seq_lens | block_tables (row-major) | logits_rows | patch_rows | patch_src |
            then per group after the first of a hybrid KV cache: slot_mapping | block_tables

Two broadcasts per step: the fixed header (so receivers know the payload's size), then the payload.
No pickling. Placeholder tokens of overlapped steps live only on rank 0's device; after patching
them in, rank 0 broadcasts its input ids on the model group (`share_input_ids`, device to device).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from pagedserve.services.engine.input_batch import GroupBatch, HostBatch
from pagedserve.services.engine.parallel.state import ParallelContext

HEADER_LEN = 11
KIND_STOP, KIND_STEP = 0, 1


@dataclass(slots=True)
class StepMessage:
    batch: HostBatch | None  # None: stop
    graph_id: int | None


def pack(batch: HostBatch, graph_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = batch.block_tables.shape
    header = torch.tensor(
        [
            KIND_STEP,
            batch.num_tokens,
            batch.num_seqs,
            rows,
            cols,
            batch.logits_rows.shape[0],
            batch.patch_rows.shape[0],
            batch.max_query_len,
            batch.max_seq_len,
            -1 if graph_id is None else graph_id,
            len(batch.groups),
        ],
        dtype=torch.int64,
    )
    parts = [
        batch.input_ids,
        batch.positions,
        batch.slot_mapping,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables.reshape(-1),
        batch.logits_rows,
        batch.patch_rows,
        batch.patch_src,
    ]
    for group in batch.groups:
        parts += [group.slot_mapping, group.block_tables.reshape(-1)]
    payload = np.concatenate([p.astype(np.int64, copy=False) for p in parts])
    return header, torch.from_numpy(payload)


def payload_len(header: list[int]) -> int:
    _, num_tokens, num_seqs, rows, cols, num_logits, num_patches = header[:7]
    num_groups = header[10]
    group_len = num_tokens + rows * cols
    return 3 * num_tokens + 2 * num_seqs + 1 + rows * cols + num_logits + 2 * num_patches + num_groups * group_len


def unpack(header: list[int], payload: np.ndarray) -> StepMessage:
    _, num_tokens, num_seqs, rows, cols, num_logits, num_patches, max_query_len, max_seq_len, graph, num_groups = header
    sizes = [
        num_tokens,
        num_tokens,
        num_tokens,
        num_seqs + 1,
        num_seqs,
        rows * cols,
        num_logits,
        num_patches,
        num_patches,
        *[num_tokens, rows * cols] * num_groups,
    ]
    arrays = np.split(payload, np.cumsum(sizes)[:-1])
    groups = tuple(
        GroupBatch(arrays[i], arrays[i + 1].astype(np.int32).reshape(rows, cols))
        for i in range(9, 9 + 2 * num_groups, 2)
    )
    batch = HostBatch(
        input_ids=arrays[0],
        positions=arrays[1],
        slot_mapping=arrays[2],
        query_start_loc=arrays[3].astype(np.int32),
        seq_lens=arrays[4].astype(np.int32),
        block_tables=arrays[5].astype(np.int32).reshape(rows, cols),
        logits_rows=arrays[6],
        patch_rows=arrays[7],
        patch_src=arrays[8],
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        groups=groups,
    )
    return StepMessage(batch, None if graph < 0 else graph)


class StepSender:
    """Rank 0's side."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx

    def send(self, batch: HostBatch, graph_id: int | None) -> None:
        header, payload = pack(batch, graph_id)
        dist.broadcast(header, src=0, group=self.ctx.step_group)
        dist.broadcast(payload, src=0, group=self.ctx.step_group)

    def share_input_ids(self, input_ids: torch.Tensor) -> None:
        self.ctx.broadcast_from_driver(input_ids)

    def send_stop(self) -> None:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)  # KIND_STOP
        dist.broadcast(header, src=0, group=self.ctx.step_group)


class StepReceiver:
    """The other ranks' side."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self._header = torch.empty(HEADER_LEN, dtype=torch.int64)

    def recv(self) -> StepMessage:
        dist.broadcast(self._header, src=0, group=self.ctx.step_group)
        header = self._header.tolist()
        if header[0] == KIND_STOP:
            return StepMessage(None, None)
        payload = torch.empty(payload_len(header), dtype=torch.int64)
        dist.broadcast(payload, src=0, group=self.ctx.step_group)
        return unpack(header, payload.numpy())
