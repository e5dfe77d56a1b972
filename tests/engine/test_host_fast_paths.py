"""The per-step host fast paths give exactly what the general paths give.

- build_host_batch's decode-only token gather and one-shot block-table fill, against a per-row reference;
- the block table kept between steps (BlockTableRows), against building it afresh each step;
- the scheduler's in-place decode rows (no allocate call), against allocate on every row;
- the engine's stop-token prefilter, against checking every row.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from pagedserve.services.engine.input_batch import (
    PLACEHOLDER_TOKEN_ID,
    BlockTableRows,
    HostBatch,
    _block_table_array,
    build_host_batch,
)
from pagedserve.services.engine.kv_cache_manager import KVCacheManager
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.request import Request
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.scheduler import ScheduledRequest, Scheduler
from tests.engine.engine_helpers import make_request
from tests.engine.test_async_steps import make_engine, run, summary, workload


def reference_host_batch(
    scheduled: list[ScheduledRequest], block_tables: list[list[int]], block_size: int, pending_rows: dict[Request, int]
) -> HostBatch:
    """The per-row construction the fast path replaced."""
    token_ids: list[int] = []
    patch_rows: list[int] = []
    patch_src: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables_rows: list[list[int]] = []
    query_start_loc, seq_lens, logits_rows = [0], [], []
    for s, blocks in zip(scheduled, block_tables, strict=True):
        end = s.num_computed_tokens + s.num_new_tokens
        for position in range(s.num_computed_tokens, end):
            token = s.request.all_token_ids[position]
            if token == PLACEHOLDER_TOKEN_ID:
                patch_rows.append(len(token_ids))
                patch_src.append(pending_rows[s.request])
                token = 0
            token_ids.append(token)
            positions.append(position)
            slots.append(blocks[position // block_size] * block_size + position % block_size)
        query_start_loc.append(len(token_ids))
        seq_lens.append(end)
        tables_rows.append(blocks)
        if s.is_sampling:
            logits_rows.append(len(token_ids) - 1)
    num_cols = -(-max(seq_lens) // block_size)
    tables = np.zeros((len(scheduled), num_cols), dtype=np.int32)
    for row, blocks in enumerate(tables_rows):
        tables[row, : min(len(blocks), num_cols)] = blocks[:num_cols]
    return HostBatch(
        np.array(token_ids),
        np.array(positions),
        np.array(slots),
        np.array(query_start_loc),
        np.array(seq_lens),
        tables,
        np.array(logits_rows),
        np.array(patch_rows),
        np.array(patch_src),
        max(s.num_new_tokens for s in scheduled),
        max(seq_lens),
    )


@pytest.mark.parametrize("decode_only", [True, False])
def test_host_batch_matches_per_row_reference(decode_only: bool) -> None:
    rng, block_size = random.Random(3), 4
    for _ in range(50):
        scheduled, tables, pending = [], [], {}
        for _ in range(rng.randint(1, 12)):
            num_tokens = rng.randint(2, 30)
            request = make_request([rng.randrange(3, 200) for _ in range(num_tokens)])
            if rng.random() < 0.6:  # its last token is the step in flight's sample
                request.all_token_ids[-1] = PLACEHOLDER_TOKEN_ID
                pending[request] = rng.randrange(64)
            num_new = 1 if decode_only else rng.randint(1, num_tokens)
            start = num_tokens - num_new if rng.random() < 0.8 else rng.randint(0, num_tokens - num_new)
            scheduled.append(ScheduledRequest(request, start, num_new, start + num_new == num_tokens))
            num_blocks = -(-(start + num_new) // block_size) + rng.choice([0, 0, 0, 2])  # sometimes spare blocks
            tables.append(rng.sample(range(500), num_blocks))
        if any(
            r.all_token_ids[s.num_computed_tokens + s.num_new_tokens - 1] == PLACEHOLDER_TOKEN_ID
            and s.num_computed_tokens + s.num_new_tokens < r.num_tokens
            for s in scheduled
            for r in [s.request]
        ):
            continue  # (cannot happen: a placeholder is a sequence's last token, scheduled last)
        got = build_host_batch(scheduled, tables, block_size, pending)
        want = reference_host_batch(scheduled, tables, block_size, pending)
        for name in HostBatch.__slots__:
            assert np.array_equal(getattr(got, name), getattr(want, name)), name


def scheduler_trace(fast: bool, seed: int) -> list[tuple]:
    """Steps of a random workload (prefix sharing, EOS stops, preemptions) as plain tuples."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    if not fast:
        kv.fits_in_place = lambda request, num_tokens: False  # type: ignore[method-assign]
    scheduler = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=20, max_model_len=64)
    shared = [rng.randrange(3, 50) for _ in range(9)]
    trace = []
    for step in range(300):
        if step < 200 and rng.random() < 0.3:
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(3, 50) for _ in range(rng.randint(1, 12))]
            scheduler.add(make_request(prompt, SamplingParams(max_tokens=rng.randint(1, 40)), request_id=f"s{step}"))
        output = scheduler.schedule()
        num_sampling = sum(s.is_sampling for s in output.scheduled)
        sampled = [2 if rng.random() < 0.03 else rng.randrange(5, 12) for _ in range(num_sampling)]  # 2: EOS
        scheduler.update(output, sampled)
        kv.check_invariants()
        trace.append(
            (
                [
                    (s.request.request_id, s.num_computed_tokens, s.num_new_tokens, s.is_sampling)
                    for s in output.scheduled
                ],
                [r.request_id for r in output.preempted],
                {r.request_id: kv.block_ids(r) for r in scheduler.running},
                dict(kv._num_published),
                kv.pool.num_cached_blocks,
                kv.num_free_blocks,
            )
        )
    return trace


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kept_block_table_matches_a_fresh_one_every_step(seed: int) -> None:
    """Steps of sequences that grow in place (reserve_slots), get new lists (allocate, a new or resumed
    sequence), reorder, leave and arrive, with tables wider and narrower than the step reads."""
    rng = random.Random(seed)
    rows = BlockTableRows()
    live: list[list[int]] = [[rng.randrange(100) for _ in range(rng.randrange(1, 4))] for _ in range(6)]
    for _ in range(60):
        for i, block_ids in enumerate(live):
            change = rng.random()
            if change < 0.3:
                block_ids.extend(rng.randrange(100) for _ in range(rng.randrange(1, 3)))  # in place
            elif change < 0.45:
                live[i] = [*block_ids, rng.randrange(100)]  # a new list, as allocate makes
        if rng.random() < 0.2:
            rng.shuffle(live)
        if rng.random() < 0.15 and len(live) > 1:
            live.pop(rng.randrange(len(live)))
        if rng.random() < 0.2:
            live.append([rng.randrange(100) for _ in range(rng.randrange(0, 5))])
        num_cols = max(map(len, live)) - (1 if rng.random() < 0.2 else 0)  # a step may read fewer blocks
        num_cols = max(num_cols, 1)
        want = _block_table_array(live, len(live), num_cols)
        got = rows.build(live, len(live), num_cols)
        np.testing.assert_array_equal(got, want)


def test_kept_block_table_grows_each_side_only_when_outgrown() -> None:
    """Sequences arriving a few a step (a 256-request burst under a token budget) must not widen the table:
    its columns doubled on every row growth once, 7 * 2**35 columns at 121 rows on an H200 run."""
    rows, live = BlockTableRows(), []
    for step in range(200):
        live.append(list(range(step % 7 + 1)))
        got = rows.build(live, len(live), 7)
        np.testing.assert_array_equal(got, _block_table_array(live, len(live), 7))
    assert rows._array.shape[1] <= 14 and rows._array.shape[0] <= 400


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_scheduler_in_place_decode_rows_match_allocate(seed: int) -> None:
    fast, general = scheduler_trace(True, seed), scheduler_trace(False, seed)
    assert fast == general
    assert any(preempted for _, preempted, *_ in fast)


class EveryToken(set):
    def __contains__(self, token_id: object) -> bool:
        return True


@pytest.mark.parametrize("num_kv_blocks", [64, 20])
def test_stop_token_prefilter_matches_checking_every_row(
    tiny_model: CausalLM, tiny_model_dir: Path, num_kv_blocks: int
) -> None:
    summaries = []
    for prefilter in (True, False):
        engine = make_engine(tiny_model, tiny_model_dir, is_async=True, num_kv_blocks=num_kv_blocks)
        if not prefilter:
            engine._stop_token_ids = EveryToken()
        for request_id, prompt, params in workload(seed=num_kv_blocks + 1):
            engine.add_request(request_id, prompt, params)
        summaries.append(summary(run(engine)))
    assert summaries[0] == summaries[1]
    assert any(reason == "stop" for _, reason, _ in summaries[0].values())
