"""The one stop rule: stop tokens after min_tokens, length at max_tokens or a full context, stop strings."""

from __future__ import annotations

import pytest

from pagedserve.shared.stop_rule import find_stop_string, held_back, is_stop_token, stop_reason

RULE = {"min_tokens": 2, "max_tokens": 4, "max_model_len": 10, "eos_token_ids": {2}, "stop_token_ids": [7]}


@pytest.mark.parametrize(
    ("token_id", "num_output", "num_tokens", "expected"),
    [
        (2, 1, 5, None),  # EOS before min_tokens: goes on (the sampler masks it anyway)
        (2, 2, 6, "stop"),
        (7, 3, 7, "stop"),  # a stop id
        (5, 4, 8, "length"),  # max_tokens
        (5, 3, 10, "length"),  # the context is full
        (2, 4, 8, "stop"),  # a stop token wins over the length limit it also reached
        (5, 3, 7, None),
    ],
)
def test_token_rule(token_id: int, num_output: int, num_tokens: int, expected: str | None) -> None:
    assert stop_reason(token_id, num_output, num_tokens, **RULE) == expected
    assert is_stop_token(token_id, num_output, 2, {2}, [7]) == (expected == "stop")


def test_text_rule() -> None:
    assert find_stop_string("Paris. The end", ["end", ". "]) == (5, ". ")  # the earliest, not the first listed
    assert find_stop_string("abcabc", ["abc"], start=1) == (3, "abc")
    assert find_stop_string("nothing", ["x"]) is None
    assert held_back(["ab", "abcd"]) == 3 and held_back([]) == 0
