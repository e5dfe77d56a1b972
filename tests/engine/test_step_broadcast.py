"""Rank 0's step as one packed int64 tensor: what the other ranks unpack is what rank 0 ran."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pagedserve.services.engine.input_batch import GroupBatch, HostBatch
from pagedserve.services.engine.parallel.step_broadcast import HEADER_LEN, pack, payload_len, unpack


def _batch() -> HostBatch:
    return HostBatch(
        input_ids=np.array([5, 6, 7, 8], np.int64),
        positions=np.array([0, 1, 2, 9], np.int64),
        slot_mapping=np.array([16, 17, 18, 41], np.int64),
        query_start_loc=np.array([0, 3, 4], np.int32),
        seq_lens=np.array([3, 10], np.int32),
        block_tables=np.array([[4, 0, 0], [8, 9, 10]], np.int32),
        logits_rows=np.array([2, 3], np.int64),
        patch_rows=np.array([3], np.int64),
        patch_src=np.array([1], np.int64),
        max_query_len=3,
        max_seq_len=10,
    )


def test_a_packed_step_unpacks_to_the_same_batch() -> None:
    batch = _batch()
    for graph_id in (None, 8):
        header, payload = pack(batch, graph_id)
        assert header.shape == (HEADER_LEN,) and payload_len(header.tolist()) == payload.shape[0]
        message = unpack(header.tolist(), payload.numpy())
        assert message.graph_id == graph_id
        got = message.batch
        assert got is not None
        for name in (
            "input_ids",
            "positions",
            "slot_mapping",
            "query_start_loc",
            "seq_lens",
            "block_tables",
            "logits_rows",
            "patch_rows",
            "patch_src",
        ):
            np.testing.assert_array_equal(getattr(got, name), getattr(batch, name), err_msg=name)
        assert (got.max_query_len, got.max_seq_len) == (3, 10)
        assert got.query_start_loc.dtype == np.int32 and got.block_tables.shape == (2, 3)


def test_a_hybrid_caches_group_tables_travel_too() -> None:
    """A hybrid KV cache's other groups: their own slots and block tables, in group order."""
    groups = tuple(
        GroupBatch(np.array([s, s + 1, s + 2, s + 9], np.int64), np.array([[s, 0, 0], [s, s + 1, 7]], np.int32))
        for s in (20, 40)
    )
    batch = replace(_batch(), groups=groups)
    header, payload = pack(batch, None)
    assert payload_len(header.tolist()) == payload.shape[0]
    got = unpack(header.tolist(), payload.numpy()).batch
    assert got is not None and len(got.groups) == 2
    for mine, theirs in zip(groups, got.groups):
        np.testing.assert_array_equal(theirs.slot_mapping, mine.slot_mapping)
        np.testing.assert_array_equal(theirs.block_tables, mine.block_tables)
        assert theirs.block_tables.dtype == np.int32
    np.testing.assert_array_equal(got.patch_src, batch.patch_src)
