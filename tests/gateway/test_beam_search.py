"""One beam-search step, and the answer's choices, without a model."""

from __future__ import annotations

from typing import Any

import pytest

from pagedserve.services.gateway import beam_response, schemas
from pagedserve.services.gateway.beam_search import Beam, BeamResult, choices_of, extend, score
from pagedserve.services.gateway.errors import APIError

EOS = 9


def test_a_step_keeps_the_best_extensions_and_finishes_eos_ones() -> None:
    beams = [Beam([1, 2], -1.0), Beam([1, 3], -2.0)]
    candidates = [
        [[4, -0.1], [EOS, -0.2], [5, -3.0], [6, -4.0]],
        [[7, -0.05], [8, -0.5], [4, -0.6], [5, -5.0]],
    ]
    live, done = extend(beams, candidates, width=2, eos_ids={EOS}, length_penalty=1.0, num_logprobs=1)
    assert [b.tokens for b in live] == [[1, 2, 4], [1, 3, 7]]  # -1.1 and -2.05 beat -2.5
    assert live[0].logprobs == [[-0.1, [[4, -0.1]]]]
    assert [(b.tokens, b.is_eos) for b in done] == [([1, 2, EOS], True)]
    assert score(done[0], 1.0) == pytest.approx(-1.2 / 2)  # a final EOS does not count in the length


def test_only_two_candidates_per_beam_and_width_are_looked_at() -> None:
    live, _ = extend([Beam([1], 0.0)], [[[2, -1.0], [3, -2.0], [4, -0.5]]], 1, set(), 1.0)
    assert [b.tokens for b in live] == [[1, 2]]  # [4, -0.5] is third: beyond 2 * width


def test_a_higher_length_penalty_favours_longer_beams() -> None:
    short, long = Beam([1, 2], -2.0), Beam([1, 2, 3, 4], -3.0)
    assert score(short, 0.0) > score(long, 0.0)  # -2 > -3: no penalty, the total logprob decides
    assert score(long, 1.0) > score(short, 1.0)  # -3 / 4 > -2 / 2


class _Tokenizer:
    eos_token_id = EOS

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_choices_cut_at_stop_strings_and_say_why_they_ended() -> None:
    beams = [Beam([0, 1, 2, EOS], -1.0, True), Beam([0, 3, 4, 5], -2.0), Beam([0, 6, 7], -9.0)]
    result = BeamResult(1, [0], beams, _Tokenizer(), None)
    first, second = choices_of(result, 2, stop=["ef"], length_penalty=1.0)
    assert (first.text, first.finish_reason, first.stop_reason, first.token_ids) == ("bc", "stop", None, [1, 2, EOS])
    assert (second.text, second.finish_reason, second.stop_reason) == ("d", "stop", "ef")
    [kept] = choices_of(result, 1, stop=[], length_penalty=1.0)
    assert kept.text == "bc"
    [with_stop] = choices_of(BeamResult(1, [0], beams[1:], _Tokenizer(), None), 1, ["ef"], 1.0, include_stop_str=True)
    assert with_stop.text == "def"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 11}, "n"),
        ({"best_of": 12}, "n"),
        ({"response_format": {"type": "json_object"}}, "use_beam_search"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "use_beam_search"),
    ],
)
def test_what_beam_search_cannot_do_is_a_400_naming_it(extra: dict[str, Any], param: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, **extra}
    cls = schemas.CompletionRequest if "best_of" in extra else schemas.ChatCompletionRequest
    if cls is schemas.CompletionRequest:
        body = {"model": "m", "prompt": "hi", "use_beam_search": True, **extra}
    with pytest.raises(APIError) as err:
        beam_response.check(cls.model_validate(body))
    assert err.value.status == 400 and err.value.param == param
