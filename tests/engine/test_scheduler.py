"""Scheduler without a model: a fake step samples token 7 for every sequence that samples."""

from __future__ import annotations

import pytest

from pagedserve.services.engine.kv_cache_manager import KVCacheManager
from pagedserve.services.engine.request import RequestStatus
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.scheduler import Scheduler, SchedulerOutput
from tests.engine.engine_helpers import make_request

BLOCK_SIZE = 4
SAMPLED = 7


def make_scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64, max_model_len: int = 128):
    kv = KVCacheManager(num_blocks, BLOCK_SIZE)
    return Scheduler(kv, max_num_seqs, budget, max_model_len), kv


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update(output, [SAMPLED] * sum(s.is_sampling for s in output.scheduled))
    scheduler.kv_cache.check_invariants()
    return output


def planned(output: SchedulerOutput) -> dict[str, tuple[int, int, bool]]:
    return {s.request.request_id: (s.num_computed_tokens, s.num_new_tokens, s.is_sampling) for s in output.scheduled}


def test_chunked_prefill_then_decode_share_steps() -> None:
    scheduler, _ = make_scheduler(budget=16)
    long = make_request(list(range(10, 50)), request_id="long", max_tokens=3)  # 40 tokens
    scheduler.add(long)
    assert planned(run_step(scheduler)) == {"long": (0, 16, False)}
    short = make_request([1, 3, 5], request_id="short", max_tokens=3)
    scheduler.add(short)
    assert planned(run_step(scheduler)) == {"long": (16, 16, False)}  # the chunk takes the budget
    assert planned(run_step(scheduler)) == {"long": (32, 8, True), "short": (0, 3, True)}
    assert planned(run_step(scheduler)) == {"long": (40, 1, True), "short": (3, 1, True)}
    assert planned(run_step(scheduler)) == {"long": (41, 1, True), "short": (4, 1, True)}
    assert short.is_finished and short.output_token_ids == [SAMPLED] * 3 and short.finish_reason == "length"
    assert long.is_finished and not scheduler.has_unfinished()
    assert scheduler.counters.num_computed_tokens == 16 + 16 + 11 + 2 + 2


def test_max_num_seqs_and_budget_limit_admission_fcfs() -> None:
    scheduler, _ = make_scheduler(max_num_seqs=2, budget=100)
    requests = [make_request([1, 2, 3], request_id=f"r{i}") for i in range(4)]
    for request in requests:
        scheduler.add(request)
    assert list(planned(run_step(scheduler))) == ["r0", "r1"]
    assert [r.request_id for r in scheduler.waiting] == ["r2", "r3"]


def test_head_of_queue_is_not_overtaken() -> None:
    scheduler, _ = make_scheduler(num_blocks=4, max_model_len=16)
    big, small = make_request(list(range(1, 14)), request_id="big"), make_request([1], request_id="small")
    holder = make_request([9, 9, 9, 9, 9], request_id="holder", max_tokens=2)
    scheduler.add(holder)
    run_step(scheduler)  # holder takes 2 of 4 blocks
    scheduler.add(big)  # needs 4 blocks: must wait
    scheduler.add(small)  # would fit, but FCFS keeps it behind `big`
    assert planned(run_step(scheduler)) == {"holder": (5, 1, True)}
    assert holder.is_finished
    assert set(planned(run_step(scheduler))) == {"big"}


def test_preempts_newest_and_resumes_until_all_finish() -> None:
    scheduler, kv = make_scheduler(num_blocks=6, budget=64, max_model_len=24)
    requests = [make_request([i + 10] * 6, request_id=f"r{i}", max_tokens=10) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    first = run_step(scheduler)
    assert len(first.scheduled) == 3  # 2 blocks each
    preempted_ids = []
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        output = run_step(scheduler)
        preempted_ids += [r.request_id for r in output.preempted]
        assert not {r.request_id for r in output.preempted} & set(planned(output))
    assert not scheduler.has_unfinished()
    assert preempted_ids[0] == "r2"  # the newest goes first
    assert scheduler.counters.num_preemptions == len(preempted_ids) > 0
    assert all(r.output_token_ids == [SAMPLED] * 10 for r in requests)
    assert kv.num_free_blocks == kv.num_blocks


def test_preempted_request_goes_to_front_and_recomputes_from_cache() -> None:
    scheduler, _ = make_scheduler(num_blocks=4, budget=64, max_model_len=16)
    old = make_request([1] * 7, request_id="old", max_tokens=3)  # finishes as "new" is preempted
    new = make_request([2] * 7, request_id="new", max_tokens=8)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)  # 2 blocks each, positions 0..6
    later = make_request([3], request_id="later")
    scheduler.add(later)
    assert set(planned(run_step(scheduler))) == {"old", "new"}  # position 7: no room for "later"
    output = run_step(scheduler)  # both need a 3rd block at position 8: "new" is preempted
    assert [r.request_id for r in output.preempted] == ["new"]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert [r.request_id for r in scheduler.waiting] == ["new", "later"]
    while not old.is_finished:
        run_step(scheduler)
    output = run_step(scheduler)
    # Readmitted: its first full block of prompt comes from the prefix cache.
    assert planned(output)["new"][0] == 4


def test_two_requests_share_a_prefix_in_one_step() -> None:
    scheduler, kv = make_scheduler()
    prefix = list(range(20, 32))  # 3 full blocks
    a, b = make_request([*prefix, 1, 2]), make_request([*prefix, 3])
    scheduler.add(a)
    scheduler.add(b)
    output = run_step(scheduler)
    assert planned(output)[b.request_id] == (12, 1, True)  # b reads a's blocks, written this step
    assert kv.block_ids(a)[:3] == kv.block_ids(b)[:3]
    assert b.num_cached_tokens == 12 and scheduler.counters.num_prefix_cache_hit_tokens == 12


def test_full_prefix_hit_computes_at_least_one_token() -> None:
    scheduler, _ = make_scheduler()
    prompt = list(range(40, 48))  # exactly 2 blocks
    first, second = make_request(prompt, max_tokens=1), make_request(prompt, max_tokens=1)
    scheduler.add(first)
    run_step(scheduler)
    scheduler.add(second)
    output = run_step(scheduler)
    assert planned(output)[second.request_id] == (4, 4, True)
    assert second.output_token_ids == [SAMPLED]


def test_stop_conditions() -> None:
    scheduler, _ = make_scheduler()
    eos = make_request([5], SamplingParams(max_tokens=4), eos_token_ids=frozenset({SAMPLED}))
    min_tokens = make_request([5], SamplingParams(max_tokens=4, min_tokens=2), eos_token_ids=frozenset({SAMPLED}))
    stop_id = make_request([5], SamplingParams(max_tokens=4, stop_token_ids=[SAMPLED]))
    ignore = make_request([5], SamplingParams(max_tokens=3, ignore_eos=True), eos_token_ids=frozenset({SAMPLED}))
    for request in (eos, min_tokens, stop_id, ignore):
        scheduler.add(request)
    while scheduler.has_unfinished():
        run_step(scheduler)
    assert (eos.finish_reason, eos.num_output_tokens) == ("stop", 1)
    assert (min_tokens.finish_reason, min_tokens.num_output_tokens) == ("stop", 2)
    assert (stop_id.finish_reason, stop_id.num_output_tokens) == ("stop", 1)
    assert (ignore.finish_reason, ignore.num_output_tokens) == ("length", 3)


def test_context_limit_finishes_with_length() -> None:
    scheduler, _ = make_scheduler(max_model_len=8)
    request = make_request([1] * 6, max_tokens=100)
    scheduler.add(request)
    while scheduler.has_unfinished():
        run_step(scheduler)
    assert request.finish_reason == "length" and request.num_tokens == 8


def test_finish_is_idempotent_and_frees_blocks() -> None:
    scheduler, kv = make_scheduler()
    running, waiting = make_request([1, 2, 3]), make_request([4, 5, 6])
    scheduler.add(running)
    run_step(scheduler)
    scheduler.add(waiting)
    scheduler.finish([running, waiting], "abort")
    scheduler.finish([running, waiting], "abort")
    assert not scheduler.has_unfinished() and kv.num_free_blocks == kv.num_blocks
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert scheduler.schedule().is_empty


def test_update_rejects_mismatched_samples() -> None:
    scheduler, _ = make_scheduler()
    scheduler.add(make_request([1, 2]))
    output = scheduler.schedule()
    with pytest.raises(ValueError):
        scheduler.update(output, [])
