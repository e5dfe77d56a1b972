"""The wire's Sampling map and the engine's SamplingParams name the same fields, so a field added to one
and not the other fails here rather than as a TypeError on a live request."""

from __future__ import annotations

from dataclasses import fields

import pytest

from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.service import sampling_params_from_wire
from pagedserve.shared.protocol import TOKENIZER_ONLY_SAMPLING, Sampling


def test_the_engine_takes_every_field_the_tokenizer_passes_on() -> None:
    engine_fields = {f.name for f in fields(SamplingParams)}
    assert set(Sampling.__annotations__) - TOKENIZER_ONLY_SAMPLING == engine_fields
    assert set(Sampling.__annotations__) >= TOKENIZER_ONLY_SAMPLING


def test_a_wire_map_becomes_checked_params() -> None:
    params = sampling_params_from_wire(Sampling(temperature=0.5, logit_bias={"7": 2.0}, min_characters=10))
    assert (params.temperature, params.logit_bias, params.min_characters) == (0.5, {7: 2.0}, 10)
    with pytest.raises(ValueError, match="top_p"):
        sampling_params_from_wire(Sampling(top_p=0.0))
