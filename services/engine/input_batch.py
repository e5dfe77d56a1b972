"""A step's flattened ragged model input: built on the host with numpy, then copied once to the device.

    scheduled   A: positions 0..4 (prompt)   B: position 9 (decode)   C: positions 16..18 (chunk)
    input_ids   [a0 a1 a2 a3 a4 | b9 | c16 c17 c18]
    query_start_loc [0, 5, 6, 9]    seq_lens [5, 10, 19]
    slot of a token = block_table[pos // block_size] * block_size + pos % block_size
    logits_rows     [4, 5, 8]  (the last row of each sequence that samples this step)

With overlapped steps a sequence's last token may still be a placeholder (PLACEHOLDER_TOKEN_ID): it
was sampled by the step still running on the GPU. Its row is listed in `patch_rows`, and the runner
copies the token from that step's device tensor (row `patch_src`) before the forward pass.

On CUDA, `InputBuffers` holds persistent device tensors (CUDA graphs read them in place) and two sets
of pinned staging arrays, used in turn: a step's host->device copies may still be pending while the
next step is prepared. The int64 fields share one tensor, the int32 ones another, so a step loads
with three copies (those two and the block tables) instead of one per field.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from pagedserve.services.engine.attention import AttentionMetadata
from pagedserve.services.engine.request import Request
from pagedserve.services.engine.scheduler import ScheduledRequest

PLACEHOLDER_TOKEN_ID = -1  # a token the GPU sampled but the host has not seen yet


@dataclass(slots=True)
class GroupBatch:
    """A hybrid KV cache group's own slots and block tables (kv_cache_groups.py: groups after the first)."""

    slot_mapping: np.ndarray  # [num_tokens] int64
    block_tables: np.ndarray  # [num_seqs, num_table_blocks] int32 (the same columns as the full group's)


@dataclass(slots=True)
class HostBatch:
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    block_tables: np.ndarray  # [num_seqs, num_table_blocks] int32 (padding reads block 0, masked out)
    logits_rows: np.ndarray  # [num_sampling (+ drafts)] int64: hidden rows whose logits are computed
    patch_rows: np.ndarray  # [num_patched] int64: rows whose token the previous step sampled
    patch_src: np.ndarray  # [num_patched] int64: that token's row in the previous step's samples
    max_query_len: int
    max_seq_len: int
    groups: tuple[GroupBatch, ...] = ()  # a hybrid KV cache's groups after the first (kv_cache_groups.py)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [num_sampling] int64
    patch_rows: torch.Tensor | None  # [num_patched] int64
    patch_src: torch.Tensor | None  # [num_patched] int64


def build_host_batch(
    scheduled: Sequence[ScheduledRequest],
    block_tables: Sequence[Sequence[int]],  # per scheduled sequence, its block ids
    block_size: int,
    pending_rows: Mapping[Request, int] | None = None,  # last token a placeholder -> its sample row
    group_tables: Sequence[Sequence[Sequence[int]]] = (),  # a hybrid cache's other groups: their block tables
    table_rows: Sequence[BlockTableRows] = (),  # kept between steps: the main table's, then each group's
) -> HostBatch:
    num_seqs = len(scheduled)
    num_new = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
    starts = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_lens = starts + num_new

    max_query_len = int(num_new.max())
    if max_query_len == 1:  # decode rows only: one token each, no slicing
        input_ids = np.fromiter(
            (s.request.all_token_ids[s.num_computed_tokens] for s in scheduled), dtype=np.int64, count=num_seqs
        )
    else:
        token_ids: list[int] = []
        for s in scheduled:
            token_ids.extend(s.request.all_token_ids[s.num_computed_tokens : s.num_computed_tokens + s.num_new_tokens])
            token_ids.extend(s.spec_token_ids)  # drafts to verify come after the last known token
        input_ids = np.array(token_ids, dtype=np.int64)
    seq_of_token = np.repeat(np.arange(num_seqs), num_new)  # [num_tokens]
    # A placeholder is always a sequence's last token, so its row is that sequence's last row.
    patch_rows = np.flatnonzero(input_ids < 0)
    patched_seqs = seq_of_token[patch_rows].tolist()
    patch_src = np.array([_patch_source(pending_rows, scheduled[seq].request) for seq in patched_seqs], dtype=np.int64)
    input_ids[patch_rows] = 0  # overwritten on the device; a valid id meanwhile
    positions = np.arange(num_tokens) - query_start_loc[:-1][seq_of_token] + starts[seq_of_token]

    num_table_blocks = int(-(-seq_lens.max() // block_size))
    tables_of = [rows.build for rows in table_rows] or [_block_table_array] * (1 + len(group_tables))
    tables = tables_of[0](block_tables, num_seqs, num_table_blocks)
    slot_mapping = tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    groups = []
    for build, group_block_tables in zip(tables_of[1:], group_tables, strict=True):
        group = build(group_block_tables, num_seqs, num_table_blocks)
        slots = group[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
        groups.append(GroupBatch(slots, group))

    sampling = np.fromiter((s.is_sampling for s in scheduled), dtype=bool, count=num_seqs)
    logits_rows = query_start_loc[1:][sampling] - 1
    if any(s.spec_token_ids for s in scheduled):  # a verify step: logits at each draft and after the last one
        num_rows = np.array([len(s.spec_token_ids) + 1 for s in scheduled if s.is_sampling], dtype=np.int64)
        first = np.repeat(logits_rows - num_rows + 1, num_rows)
        logits_rows = first + np.arange(int(num_rows.sum())) - np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    return HostBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_tables=tables,
        logits_rows=logits_rows,
        patch_rows=patch_rows.astype(np.int64, copy=False),
        patch_src=patch_src,
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max()),
        groups=tuple(groups),
    )


def _patch_source(pending_rows: Mapping[Request, int] | None, request: Request) -> int:
    row = pending_rows.get(request) if pending_rows else None
    assert row is not None, "a placeholder token without its source"
    return row


def _block_table_array(block_tables: Sequence[Sequence[int]], num_seqs: int, num_cols: int) -> np.ndarray:
    """[num_seqs, num_cols] int32, each row its sequence's block ids then zeros (filled in one masked write)."""
    tables = np.zeros((num_seqs, num_cols), dtype=np.int32)
    lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=num_seqs)
    if num_seqs and int(lengths.max()) > num_cols:  # more blocks than this step reads: keep the first ones
        for row, block_ids in enumerate(block_tables):
            used = block_ids[:num_cols]
            tables[row, : len(used)] = used
        return tables
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(lengths.sum()))
    tables[np.arange(num_cols) < lengths[:, None]] = flat
    return tables


class BlockTableRows:
    """A block table kept from step to step and rewritten only where a sequence's block list changed.

    `_block_table_array` walks every block id of every sequence each step (at 256 sequences of 768 tokens, 12k
    ids: 6% of a served engine's host time on an H100). A sequence's list only grows in place (KVCacheManager.
    reserve_slots extends it) or is replaced by a new list (allocate, a new or resumed sequence), so a row whose
    list is the same object as last step's needs the ids past those it holds, and most rows need none. Rows hold
    zeros past their ids, as `_block_table_array`'s do. `build` returns a copy: a step's batch must not change
    when the next one is built while it runs."""

    def __init__(self) -> None:
        self._array = np.zeros((0, 0), dtype=np.int32)
        self._lists: list[Sequence[int] | None] = []  # per row, the list it was written from
        self._written: list[int] = []  # per row, how many of that list's ids it holds

    def build(self, block_tables: Sequence[Sequence[int]], num_seqs: int, num_cols: int) -> np.ndarray:
        rows, cols = self._array.shape
        if num_seqs > rows or num_cols > cols:  # grown, each side doubling only when it is the one outgrown
            rows = max(num_seqs, 2 * rows) if num_seqs > rows else rows
            cols = max(num_cols, 2 * cols) if num_cols > cols else cols
            self._array = np.zeros((rows, cols), dtype=np.int32)
            self._lists, self._written = [None] * rows, [0] * rows
        array, lists, written = self._array, self._lists, self._written
        for row, block_ids in enumerate(block_tables):
            held, n = written[row], min(len(block_ids), cols)
            if lists[row] is block_ids:
                if n > held:
                    array[row, held:n] = block_ids[held:n]
            else:
                array[row, :n] = block_ids[:n]
                if held > n:
                    array[row, n:held] = 0
                lists[row] = block_ids
            written[row] = n
        return array[:num_seqs, :num_cols].copy()


def pad_decode_batch(batch: HostBatch, num_seqs: int) -> HostBatch:
    """A decode-only batch grown to `num_seqs` one-token sequences (a captured graph's size).

    Padding sequences write no K/V (slot -1) and attend to one key of whatever block their stale
    block-table row names: finite values, and their rows are never read."""
    num_pad = num_seqs - batch.num_seqs
    assert batch.max_query_len == 1 and num_pad >= 0
    if num_pad == 0:
        return batch
    padded = pad_eager_batch(batch, batch.num_tokens + num_pad)  # one token per padding sequence
    # Rows past the real ones in the block table keep their stale (valid) ids.
    return replace(
        padded,
        query_start_loc=np.arange(num_seqs + 1, dtype=np.int32),
        seq_lens=np.concatenate([batch.seq_lens, np.ones(num_pad, dtype=np.int32)]),
    )


def eager_token_bucket(num_tokens: int) -> int:
    """The token count an eager (non-graph) CUDA step runs with: rounded up so that step sizes repeat.

    cuBLAS picks a GEMM algorithm per (M, N, K) and caches the choice; a token count it has not seen
    costs ~150-300 µs of host time per linear layer (measured on an H100), which made every prefill
    step of a small model host-bound. A few dozen buckets keep the padding under ~3%."""
    step = 16 if num_tokens <= 256 else 64 if num_tokens <= 2048 else 256
    return -(-num_tokens // step) * step


def pad_eager_batch(batch: HostBatch, num_tokens: int) -> HostBatch:
    """`batch` with padding tokens appended up to `num_tokens`: they belong to no sequence (query_start_loc
    ends at the real count), write no K/V (slot -1) and are never sampled; every layer treats rows
    independently, so whatever they compute stays in their own rows."""
    num_pad = num_tokens - batch.num_tokens
    assert num_pad >= 0
    if num_pad == 0:
        return batch
    zeros = np.zeros(num_pad, dtype=np.int64)
    return replace(
        batch,
        input_ids=np.concatenate([batch.input_ids, zeros]),
        positions=np.concatenate([batch.positions, zeros]),
        slot_mapping=np.concatenate([batch.slot_mapping, zeros - 1]),
        groups=tuple(replace(g, slot_mapping=np.concatenate([g.slot_mapping, zeros - 1])) for g in batch.groups),
    )


def pad_mixed_batch(batch: HostBatch, num_tokens: int, num_seqs: int) -> HostBatch:
    """`batch` grown to a mixed graph's shape: padding tokens as in `pad_eager_batch`, and padding sequences
    with no tokens and no context (query_start_loc repeats its end; a zero block-table row), which the
    attention kernels skip."""
    num_pad = num_seqs - batch.num_seqs
    assert num_pad >= 0 and batch.max_query_len > 1
    padded = pad_eager_batch(batch, num_tokens)
    if num_pad == 0:
        return padded
    end = batch.query_start_loc[-1]
    tables = batch.block_tables
    return replace(
        padded,
        query_start_loc=np.concatenate([batch.query_start_loc, np.full(num_pad, end, dtype=np.int32)]),
        seq_lens=np.concatenate([batch.seq_lens, np.zeros(num_pad, dtype=np.int32)]),
        block_tables=np.concatenate([tables, np.zeros((num_pad, tables.shape[1]), dtype=np.int32)]),
        groups=tuple(
            replace(g, block_tables=np.concatenate([g.block_tables, np.zeros((num_pad, tables.shape[1]), np.int32)]))
            for g in padded.groups
        ),
    )


def to_model_input(batch: HostBatch, device: torch.device, layer_groups: list[int] | None = None) -> ModelInput:
    """Fresh tensors (the CPU path, where a copy is a no-op). `layer_groups`: each layer's group, with groups."""

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    has_patches = batch.patch_rows.shape[0] > 0
    meta = AttentionMetadata(
        tensor(batch.slot_mapping),
        tensor(batch.query_start_loc),
        tensor(batch.seq_lens),
        tensor(batch.block_tables),
        batch.max_query_len,
        batch.max_seq_len,
    )
    if batch.groups:
        assert layer_groups is not None
        meta.with_groups([(tensor(g.slot_mapping), tensor(g.block_tables)) for g in batch.groups], layer_groups)
    return ModelInput(
        input_ids=tensor(batch.input_ids),
        positions=tensor(batch.positions),
        meta=meta,
        logits_rows=tensor(batch.logits_rows),
        patch_rows=tensor(batch.patch_rows) if has_patches else None,
        patch_src=tensor(batch.patch_src) if has_patches else None,
    )


# Device layout: each dtype's fields back to back in one tensor, per-sequence fields first, so that
# one copy of a prefix of the staging tensor (up to the last field's used part) loads them all.
_INT64_FIELDS = ("logits_rows", "patch_rows", "patch_src", "input_ids", "positions", "slot_mapping")
_INT32_FIELDS = ("seq_lens", "query_start_loc")


class InputBuffers:
    """Persistent device inputs, filled from pinned staging arrays with asynchronous copies: one per
    dtype and one for the block tables, three per step."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        layer_groups: Sequence[int] = (),  # a hybrid KV cache: each layer's group (the others' slots and tables)
    ) -> None:
        self.device = device
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        lengths = {
            "input_ids": max_num_tokens,
            "positions": max_num_tokens,
            "slot_mapping": max_num_tokens,
            "query_start_loc": max_num_seqs + 1,
            "seq_lens": max_num_seqs,
            "logits_rows": max_num_tokens,  # a verify step has a row per draft too
            "patch_rows": max_num_seqs,
            "patch_src": max_num_seqs,
        }
        self._offsets: dict[str, int] = {}
        for names in (_INT64_FIELDS, _INT32_FIELDS):
            offset = 0
            for name in names:
                self._offsets[name] = offset
                offset += lengths[name]
        self._lengths = lengths
        size64 = sum(lengths[n] for n in _INT64_FIELDS)
        size32 = sum(lengths[n] for n in _INT32_FIELDS)
        self._device64 = torch.zeros(size64, dtype=torch.int64, device=device)
        self._device32 = torch.zeros(size32, dtype=torch.int32, device=device)
        self.device_1d = {
            name: self._field(self._device64 if name in _INT64_FIELDS else self._device32, name) for name in lengths
        }
        self.device_1d["seq_lens"].fill_(1)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        num_table_entries = max_num_seqs * max_blocks_per_seq
        self._staging = [
            (
                torch.zeros(size64, dtype=torch.int64, pin_memory=pin),
                torch.zeros(size32, dtype=torch.int32, pin_memory=pin),
                torch.zeros(num_table_entries, dtype=torch.int32, pin_memory=pin),
            )
            for _ in range(2)
        ]
        self._turn = 0
        self.layer_groups = list(layer_groups)
        self.groups = [
            GroupBuffers(max_num_tokens, max_num_seqs, max_blocks_per_seq, device)
            for _ in range(max(self.layer_groups, default=0))
        ]

    def _stage(
        self,
        batch: HostBatch,
        names: tuple[str, ...],
        staging: torch.Tensor,
        device_flat: torch.Tensor,
        views: dict[str, torch.Tensor],
    ) -> None:
        """Write the fields into the staging tensor at their offsets; one copy of the used prefix."""
        staged = staging.numpy()
        end = 0
        for name in names:
            array: np.ndarray = getattr(batch, name)
            start, n = self._offsets[name], array.shape[0]
            staged[start : start + n] = array
            views[name] = device_flat[start : start + n]
            if n:
                end = start + n
        device_flat[:end].copy_(staging[:end], non_blocking=True)

    def _field(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        offset = self._offsets[name]
        return flat[offset : offset + self._lengths[name]]

    def load(self, batch: HostBatch) -> ModelInput:
        """Copy `batch` into the persistent tensors; the returned tensors are views of them."""
        assert batch.num_tokens <= self.max_num_tokens and batch.num_seqs <= self.max_num_seqs
        staging64, staging32, staging_tables = self._staging[self._turn]
        self._turn ^= 1
        views: dict[str, torch.Tensor] = {}
        self._stage(batch, _INT64_FIELDS, staging64, self._device64, views)
        self._stage(batch, _INT32_FIELDS, staging32, self._device32, views)
        num_seqs, num_cols = batch.block_tables.shape
        staged_tables = staging_tables[: num_seqs * num_cols].view(num_seqs, num_cols)
        staged_tables.numpy()[:] = batch.block_tables
        self.block_tables[:num_seqs, :num_cols].copy_(staged_tables, non_blocking=True)
        has_patches = batch.patch_rows.shape[0] > 0
        # Full-width table rows: the shape a captured graph saw (kernels read only the used columns).
        meta = AttentionMetadata(
            views["slot_mapping"],
            views["query_start_loc"],
            views["seq_lens"],
            self.block_tables[:num_seqs],
            batch.max_query_len,
            batch.max_seq_len,
        )
        assert len(batch.groups) == len(self.groups)
        turn = self._turn ^ 1  # the staging set this call used
        meta.with_groups([g.load(group, turn) for g, group in zip(self.groups, batch.groups)], self.layer_groups)
        return ModelInput(
            input_ids=views["input_ids"],
            positions=views["positions"],
            meta=meta,
            logits_rows=views["logits_rows"],
            patch_rows=views["patch_rows"] if has_patches else None,
            patch_src=views["patch_src"] if has_patches else None,
        )


class GroupBuffers:
    """A hybrid KV cache group's persistent slot mapping and block tables, with their two pinned staging sets."""

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._staging = [
            (
                torch.zeros(max_num_tokens, dtype=torch.int64, pin_memory=pin),
                torch.zeros(max_num_seqs * max_blocks_per_seq, dtype=torch.int32, pin_memory=pin),
            )
            for _ in range(2)
        ]

    def load(self, group: GroupBatch, turn: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the group's slots and tables in (staging set `turn`); views of them (slots, tables)."""
        staging_slots, staging_tables = self._staging[turn]
        num_tokens = group.slot_mapping.shape[0]
        staging_slots.numpy()[:num_tokens] = group.slot_mapping
        self.slot_mapping[:num_tokens].copy_(staging_slots[:num_tokens], non_blocking=True)
        num_seqs, num_cols = group.block_tables.shape
        staged_tables = staging_tables[: num_seqs * num_cols].view(num_seqs, num_cols)
        staged_tables.numpy()[:] = group.block_tables
        self.block_tables[:num_seqs, :num_cols].copy_(staged_tables, non_blocking=True)
        return self.slot_mapping[:num_tokens], self.block_tables[:num_seqs]

    def for_graph(self, num_tokens: int, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots and full-width tables a captured graph of that shape reads."""
        return self.slot_mapping[:num_tokens], self.block_tables[:num_seqs]
