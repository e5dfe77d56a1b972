"""bench.first_burst: three identical bursts on one engine, each timed step by step with its first tokens."""

from __future__ import annotations

from bench.first_burst import run
from bench.host_step import tiny_model_dir
from pagedserve.services.engine.engine import Engine
from pagedserve.shared.config import Config


def test_each_burst_is_timed_step_by_step_with_its_first_tokens() -> None:
    engine = Engine(Config.of(model=str(tiny_model_dir()), device="cpu", profile_steps=True, cpu_threads=1))
    bursts = run(engine, requests=6, input_len=20, output_len=4, vocab_size=200)
    assert [b["burst"] for b in bursts] == ["first", "second", "third"]
    for burst in bursts:
        assert burst["steps"] == len(burst["steps_ms"]) >= 4  # at least one step per output token
        # rounded figures (seconds to the ms): compared within what the rounding allows
        assert abs(sum(burst["steps_ms"]) / 1e3 - burst["seconds"]) < 0.01
        assert 0 < burst["first_token_ms"]["p50"] <= burst["first_token_ms"]["max"] <= burst["seconds"] * 1e3 + 1
        low, high = burst["seconds"] - 0.0005, burst["seconds"] + 0.0005  # where the unrounded time lies
        assert 6 * 4 / high - 0.1 <= burst["output_tokens_per_s"] <= 6 * 4 / low + 0.1
        steps = sum(kind["steps"] for kind in burst["step_profile"].values())
        assert steps == burst["steps"]  # the profile holds this burst alone
    assert not engine.has_unfinished()
