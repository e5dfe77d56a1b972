"""Step profiling: host phases charged to the kind of step, per-step means in the summary."""

from __future__ import annotations

import time

from pagedserve.services.engine.step_profile import HOST_PHASES, LoopProfile, StepProfile


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


def test_loop_profile_sums_phases_per_step_and_starts_afresh_after_reset() -> None:
    off = LoopProfile()
    off.start()
    off.mark("step")
    assert off.summary()["ms_per_step"] == {}  # off: nothing is timed
    profile = LoopProfile(enabled=True)
    for _ in range(2):
        profile.start()
        profile.num_steps += 1
        time.sleep(0.002)
        profile.mark("step")
        profile.mark("publish")
    summary = profile.summary()
    assert summary["steps"] == 2 and summary["ms_per_step"]["step"] >= 2.0
    assert 0 <= summary["ms_per_step"]["publish"] < summary["ms_per_step"]["step"]
    profile.note_thread_cpu("compute")
    assert profile.summary()["thread_cpu_s"]["compute"] > 0
    profile.reset()
    assert profile.summary()["steps"] == 0 and profile.summary()["ms_per_step"] == {}
