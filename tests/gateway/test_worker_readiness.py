"""Gateway workers share their readiness: /ready on one worker holds only while it holds on every worker."""

from __future__ import annotations

import multiprocessing

from pagedserve.services.gateway.worker_readiness import WorkerReadiness


def test_ready_only_while_every_worker_is() -> None:
    flags = multiprocessing.get_context("spawn").RawArray("b", 3)  # what run_workers hands its workers
    workers = [WorkerReadiness(flags, i) for i in range(3)]
    assert not workers[0].all_ready()  # nobody has said anything yet
    for worker in workers[:2]:
        worker.publish(True)
    assert not any(w.all_ready() for w in workers)  # the third is still loading its tokenizer
    workers[2].publish(True)
    assert all(w.all_ready() for w in workers)
    workers[1].publish(False)  # draining, or Redis lost
    assert not any(w.all_ready() for w in workers)
