"""Priority scheduling (--scheduling-policy priority): admission takes the most urgent (lowest
`priority`) first, preemption the least urgent, FCFS within a level; fcfs ignores priorities."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.kv_cache_manager import KVCacheManager
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.outputs import RequestOutput
from pagedserve.services.engine.request import Request
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.scheduler import Scheduler
from pagedserve.services.engine.waiting_queue import FCFSQueue, PriorityQueue, waiting_queue
from pagedserve.shared.config import Config
from tests.engine.engine_helpers import make_request
from tests.engine.test_scheduler import BLOCK_SIZE, SAMPLED, planned, run_step


def _request(name: str, priority: int, prompt_len: int = 3, max_tokens: int = 4) -> Request:
    return make_request([5] * prompt_len, SamplingParams(max_tokens=max_tokens, priority=priority), request_id=name)


def _scheduler(policy: str, num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BLOCK_SIZE), max_num_seqs, 64, 64, policy)


def test_the_priority_queue_orders_by_level_then_arrival() -> None:
    queue = PriorityQueue()
    a, b, c, d = _request("a", 1), _request("b", 0), _request("c", 1), _request("d", -5)
    for request in (a, b, c, d):
        queue.add(request)
    assert [r.request_id for r in queue] == ["d", "b", "a", "c"]
    queue.remove(b)
    with pytest.raises(ValueError):
        queue.remove(b)
    assert [queue.pop().request_id for _ in range(len(queue))] == ["d", "a", "c"]
    fcfs = FCFSQueue()
    for request in (a, b):
        fcfs.add(request)
    fcfs.add_preempted(c)
    assert [r.request_id for r in fcfs] == ["c", "a", "b"]
    with pytest.raises(ValueError, match="scheduling_policy"):
        waiting_queue("lifo")


def test_admission_takes_the_most_urgent_first_and_fcfs_within_a_level() -> None:
    scheduler = _scheduler("priority", max_num_seqs=2)
    for name, priority in (("batch1", 5), ("batch2", 5), ("chat1", 0), ("chat2", 0)):
        scheduler.add(_request(name, priority, max_tokens=1))
    assert set(planned(run_step(scheduler))) == {"chat1", "chat2"}
    assert [r.request_id for r in scheduler.waiting] == ["batch1", "batch2"]
    assert list(planned(run_step(scheduler))) == ["batch1", "batch2"]


def test_fcfs_ignores_priorities() -> None:
    scheduler = _scheduler("fcfs", max_num_seqs=2)
    for name, priority in (("batch1", 5), ("batch2", 5), ("chat1", 0)):
        scheduler.add(_request(name, priority, max_tokens=1))
    assert set(planned(run_step(scheduler))) == {"batch1", "batch2"}


def test_a_saturated_cache_preempts_the_least_urgent_and_serves_the_urgent_first() -> None:
    """Six blocks of 4 tokens, three sequences of 6 prompt + 10 output tokens: they cannot all fit."""
    scheduler = _scheduler("priority", num_blocks=6)
    urgent, normal, batch = _request("urgent", -1, 6, 10), _request("normal", 0, 6, 10), _request("batch", 3, 6, 10)
    for request in (batch, normal, urgent):  # the least urgent arrives first
        scheduler.add(request)
    first = run_step(scheduler)
    assert list(planned(first)) == ["urgent", "normal", "batch"]
    preempted: list[str] = []
    finished: list[str] = []
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        output = run_step(scheduler)
        preempted += [r.request_id for r in output.preempted]
        finished += [s.request.request_id for s in output.scheduled if s.request.is_finished]
        assert not {r.request_id for r in output.preempted} & set(planned(output))
    assert preempted and preempted[0] == "batch" and "urgent" not in preempted
    assert finished[0] == "urgent" and finished[-1] == "batch"
    assert all(r.output_token_ids == [SAMPLED] * 10 for r in (urgent, normal, batch))
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_the_engine_serves_by_priority(tiny_model: CausalLM, tiny_model_dir: Path) -> None:
    config = Config.of(
        model=str(tiny_model_dir), num_kv_blocks=64, block_size=4, max_num_seqs=1, scheduling_policy="priority"
    )
    engine = Engine(config, model=tiny_model)
    for name, priority in (("batch", 9), ("later", 1), ("urgent", -1)):
        engine.add_request(name, [3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True, priority=priority))
    finished = [out.request_id for out in _outputs(engine) if out.finish_reason is not None]
    assert finished == ["urgent", "later", "batch"]


def _outputs(engine: Engine) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs
