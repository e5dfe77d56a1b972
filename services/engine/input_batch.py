"""A step's flattened ragged model input, built on the host with numpy and copied once to the device.

    scheduled   A: positions 0..4 (prompt)   B: position 9 (decode)   C: positions 16..18 (chunk)
    input_ids   [a0 a1 a2 a3 a4 | b9 | c16 c17 c18]
    query_start_loc [0, 5, 6, 9]    seq_lens [5, 10, 19]
    slot of a token = block_table[pos // block_size] * block_size + pos % block_size
    logits_rows     [4, 5, 8]  (the last row of each sequence that samples this step)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.attention import AttentionMetadata
from services.engine.scheduler import ScheduledRequest


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [num_sampling] int64: hidden rows whose logits are computed


def prepare_inputs(
    scheduled: Sequence[ScheduledRequest],
    block_tables: Sequence[Sequence[int]],  # per scheduled sequence, its block ids
    block_size: int,
    device: torch.device,
) -> ModelInput:
    num_seqs = len(scheduled)
    num_new = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
    starts = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_lens = starts + num_new

    token_ids: list[int] = []
    for s in scheduled:
        token_ids.extend(s.request.all_token_ids[s.num_computed_tokens : s.num_computed_tokens + s.num_new_tokens])
    seq_of_token = np.repeat(np.arange(num_seqs), num_new)  # [num_tokens]
    positions = np.arange(num_tokens) - query_start_loc[:-1][seq_of_token] + starts[seq_of_token]

    num_table_blocks = int(-(-seq_lens.max() // block_size))
    tables = np.zeros((num_seqs, num_table_blocks), dtype=np.int64)  # padding reads block 0, masked out
    for row, block_ids in enumerate(block_tables):
        used = block_ids[:num_table_blocks]
        tables[row, : len(used)] = used
    slot_mapping = tables[seq_of_token, positions // block_size] * block_size + positions % block_size

    sampling = np.fromiter((s.is_sampling for s in scheduled), dtype=bool, count=num_seqs)
    logits_rows = query_start_loc[1:][sampling] - 1

    def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(device=device, dtype=dtype, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, torch.int64),
        query_start_loc=to_device(query_start_loc, torch.int32),
        seq_lens=to_device(seq_lens, torch.int32),
        block_tables=to_device(tables, torch.int32),
        max_query_len=int(num_new.max()),
        max_seq_len=int(seq_lens.max()),
    )
    return ModelInput(
        input_ids=torch.tensor(token_ids, dtype=torch.int64).to(device, non_blocking=True),
        positions=to_device(positions, torch.int64),
        meta=meta,
        logits_rows=to_device(logits_rows, torch.int64),
    )
