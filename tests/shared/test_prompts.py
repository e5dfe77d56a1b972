"""first_out_of_vocab: the id check every prompt of ids goes through (a C-level pass when all are fine)."""

from __future__ import annotations

import pytest

from pagedserve.shared.prompts import first_out_of_vocab


@pytest.mark.parametrize(
    ("ids", "found"),
    [
        ([0, 5, 99], None),
        (list(range(100)), None),
        ([3, 100, 4], 100),
        ([3, -1, 200], -1),
        ([1, True, 2], True),  # a bool is not a token id
        ([1, 2.0, 3], 2.0),
        ([1, "7"], "7"),
        ([], None),
        ((i for i in (1, 150)), 150),  # any iterable, not only lists
    ],
)
def test_the_first_id_outside_the_vocabulary_is_named(ids: object, found: object) -> None:
    result = first_out_of_vocab(ids, 100)
    assert result == found and type(result) is type(found)
