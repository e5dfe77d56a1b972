"""The /v1/embeddings request schema and response encoding (services/gateway/embeddings.py)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from pydantic import ValidationError

from pagedserve.services.gateway.embeddings import EmbeddingRequest, _encoded, _truncation


@pytest.mark.parametrize(
    ("given", "inputs"),
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_every_input_shape_is_a_list_of_inputs(given, inputs) -> None:
    assert EmbeddingRequest(model="m", input=given).inputs == inputs


@pytest.mark.parametrize("bad", ["", [], ["a", ""], [[]], ["a", [1]], [1, -2], [True], [1.5]])
def test_bad_inputs_are_refused(bad) -> None:
    with pytest.raises(ValidationError):
        EmbeddingRequest(model="m", input=bad)


def test_other_fields() -> None:
    req = EmbeddingRequest(model="m", input="x", encoding_format="base64", dimensions=8, user="u")
    assert (req.encoding_format, req.dimensions, req.is_stream, req.token_budget) == ("base64", 8, False, None)
    assert _truncation(req) == {}
    cut = EmbeddingRequest(model="m", input="x", truncate_prompt_tokens=5, truncation_side="right")
    assert _truncation(cut) == {"truncate_prompt_tokens": 5, "truncation_side": "right"}
    for bad in ({"encoding_format": "int8"}, {"dimensions": 0}, {"dimensions": "8"}, {"truncate_prompt_tokens": -2}):
        with pytest.raises(ValidationError):
            EmbeddingRequest(model="m", input="x", **bad)


def test_base64_is_little_endian_float32() -> None:
    vector = [0.5, -1.25, 3.0e-3]
    encoded = _encoded(vector, "base64")
    assert isinstance(encoded, str)
    assert np.frombuffer(base64.b64decode(encoded), dtype="<f4").tolist() == pytest.approx(vector)
    assert _encoded(vector, "float") == vector
