"""The engine service never publishes tokens of a request whose earlier tokens were lost."""

from __future__ import annotations

from collections import OrderedDict

from services.engine.service import _without_requests
from shared.protocol import TokenDeltas


def deltas() -> TokenDeltas:
    return TokenDeltas("eng", 7, ["a", "b", "a"], [0, 0, 1], [[1], [2], [3]], [None, None, None],
                       [None, "length", None], [4, 5, 4], [1, 9, 1], [0, 0, 0])


def test_lost_requests_are_dropped_column_by_column() -> None:
    kept = _without_requests(deltas(), OrderedDict.fromkeys(["a"]))
    assert (kept.engine_id, kept.step) == ("eng", 7)
    assert (kept.request_ids, kept.indexes, kept.token_ids, kept.finish_reasons) == (["b"], [0], [[2]], ["length"])
    assert (kept.num_prompt_tokens, kept.num_output_tokens, kept.num_cached_tokens, kept.logprobs) == (
        [5], [9], [0], [None])


def test_nothing_lost_keeps_the_message() -> None:
    original = deltas()
    assert _without_requests(original, OrderedDict.fromkeys(["zzz"])) is original
    assert _without_requests(original, OrderedDict.fromkeys(["a", "b"])).request_ids == []
