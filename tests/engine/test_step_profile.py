"""Step profiling: host phases charged to the kind of step, per-step means in the summary."""

from __future__ import annotations

import time

from pagedserve.services.engine.step_profile import HOST_PHASES, StepProfile


def test_host_phases_sum_per_kind_and_average_per_step() -> None:
    profile = StepProfile(enabled=True)
    for kind in ("eager", "graph", "graph"):
        profile.start()
        time.sleep(0.002)
        profile.mark("schedule")
        profile.mark("forward")
        profile.end_call(kind)
        profile.count_step(kind, num_tokens=10 if kind == "eager" else 4, marks=None)
    summary = profile.summary()
    assert summary["eager"]["steps"] == 1 and summary["graph"]["steps"] == 2
    assert summary["graph"]["tokens_per_step"] == 4.0
    assert set(summary["graph"]["host_ms"]) == set(HOST_PHASES)
    assert summary["graph"]["host_ms"]["schedule"] >= 2.0  # the sleep went to the phase marked after it
    assert summary["graph"]["host_ms"]["forward"] < summary["graph"]["host_ms"]["schedule"]
    profile.reset()
    assert profile.summary() == {}


def test_a_disabled_profile_records_nothing() -> None:
    profile = StepProfile()
    profile.start()
    profile.mark("schedule")
    profile.end_call("eager")
    profile.count_step("eager", 3, None)
    assert profile.summary() == {}
