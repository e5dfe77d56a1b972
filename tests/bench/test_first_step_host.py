"""bench.first_step_host: a new request's first engine call, timed and split into the step profile's phases."""

from __future__ import annotations

import pytest

from bench.first_step_host import measure
from bench.host_step import tiny_model_dir
from pagedserve.services.engine.engine import Engine
from pagedserve.shared.config import Config


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(Config.of(model=str(tiny_model_dir()), device="cpu", profile_steps=True, cpu_threads=1))


def test_first_call_is_timed_and_split_into_phases(engine: Engine) -> None:
    row = measure(engine, prompt_len=24, requests=3, profiler=None)
    phases = row["first_call_phase_ms_p50"]
    assert row["prompt_len"] == 24 and row["add_ms_p50"] > 0
    assert {"schedule", "prepare", "forward"} <= phases.keys()
    # the phases are parts of the first call (its forward pass included: the engine here is synchronous)
    assert 0 < sum(phases.values()) <= row["first_call_ms_p50"] * 1.05
    assert not engine.has_unfinished()
