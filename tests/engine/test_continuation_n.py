"""n > 1 continuations: some choices of a request another replica began resume here, each from its own tokens,
under its original index; choices not listed (finished elsewhere) never run again."""

from __future__ import annotations

import pytest

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.service import _resumed_choices
from pagedserve.shared.protocol import GenerateRequest
from tests.engine.engine_helpers import run, tokens_of

PROMPT = [5, 6, 7]


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


def test_each_choice_continues_from_its_own_tokens(engine: Engine) -> None:
    # Greedy continuations are deterministic, so each choice must match an n=1 continuation of its prefix.
    full = engine.generate([PROMPT], greedy(10))[0].token_ids
    other_prefix = [40, 41, 42]  # a different history for choice 1
    engine.add_request("one", PROMPT, greedy(10), output_token_ids=other_prefix)
    expected_1 = tokens_of(run(engine)["one", 0])
    engine.add_request("two", PROMPT, greedy(10, n=2), choice_output_token_ids={0: full[:4], 1: other_prefix})
    results = run(engine)
    assert set(results) == {("two", 0), ("two", 1)}
    assert tokens_of(results["two", 0]) == full[4:]  # no token of the prefix again, none lost
    assert tokens_of(results["two", 1]) == expected_1
    for index, prefix in ((0, full[:4]), (1, other_prefix)):
        last = results["two", index][-1]
        assert last.finish_reason == "length" and last.num_output_tokens == 10
        assert len(prefix) + len(tokens_of(results["two", index])) == 10


def test_only_the_listed_choices_run_under_their_indexes(engine: Engine) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, n=3)
    engine.add_request("some", PROMPT, params, choice_output_token_ids={2: [9, 9]})
    results = run(engine)
    assert set(results) == {("some", 2)}
    assert len(tokens_of(results["some", 2])) == 4 and results["some", 2][-1].finish_reason == "length"
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_a_choice_already_at_max_tokens_finishes_without_tokens(engine: Engine) -> None:
    engine.add_request("full", PROMPT, greedy(2, n=2), choice_output_token_ids={0: [9, 9], 1: [8]})
    results = run(engine)
    assert [(o.new_token_ids, o.finish_reason) for o in results["full", 0]] == [([], "length")]
    assert len(tokens_of(results["full", 1])) == 1 and results["full", 1][-1].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"choice_output_token_ids": {2: [9]}}, "n"),  # index outside 0..n-1
        ({"choice_output_token_ids": {}}, "n"),  # nothing to resume
        ({"output_token_ids": [9]}, "n"),  # one shared list for n = 2
        ({"output_token_ids": [9], "choice_output_token_ids": {0: [9]}}, "output_token_ids"),
        ({"choice_output_token_ids": {0: [999]}}, "prompt"),  # outside the vocabulary
    ],
)
def test_bad_continuations_are_refused(engine: Engine, kwargs: dict, param: str) -> None:
    with pytest.raises(ValueError, match=f"^{param}:"):
        engine.add_request("bad", PROMPT, greedy(4, n=2), **kwargs)
    assert not engine.has_unfinished()


def test_the_wire_form_maps_indexes_to_tokens() -> None:
    req = GenerateRequest("r", "gw", "m", PROMPT, {}, choice_indexes=[0, 2], choice_output_token_ids=[[1], [2, 3]])
    assert _resumed_choices(req) == {0: [1], 2: [2, 3]}
    assert _resumed_choices(GenerateRequest("r", "gw", "m", PROMPT, {}, output_token_ids=[4])) is None
    for indexes, tokens in (([0], [[1], [2]]), ([1, 1], [[1], [2]])):
        with pytest.raises(ValueError, match=r"^choice_indexes:"):
            _resumed_choices(
                GenerateRequest("r", "gw", "m", PROMPT, {}, choice_indexes=indexes, choice_output_token_ids=tokens)
            )
