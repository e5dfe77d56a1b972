"""vLLM's logits processing fields on the engine: allowed_token_ids, bad_words (as token sequences),
and cache_salt's separate prefix-cache chains."""

from __future__ import annotations

import pytest

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import run, tokens_of

PROMPT = [3, 17, 42, 99, 5, 250, 8, 11]


def _generate(engine: Engine, params: SamplingParams, prompt: list[int] = PROMPT) -> list[int]:
    engine.add_request("r", prompt, params)
    return tokens_of(run(engine)[("r", 0)])


def test_only_allowed_ids_are_sampled(engine: Engine) -> None:
    for temperature in (0.0, 1.5):
        got = _generate(
            engine,
            SamplingParams(
                max_tokens=24, temperature=temperature, seed=1, ignore_eos=True, allowed_token_ids=[40, 41, 42]
            ),
        )
        assert len(got) == 24 and set(got) <= {40, 41, 42}


def test_a_one_token_bad_word_never_appears(engine: Engine) -> None:
    plain = _generate(engine, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    banned = plain[3]
    first = plain.index(banned)
    got = _generate(
        engine, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, bad_words_token_ids=[[banned]])
    )
    assert banned not in got and got[:first] == plain[:first]


def test_a_longer_bad_word_bans_only_its_completion(engine: Engine) -> None:
    plain = _generate(engine, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    word = plain[4:6]  # greedy would write these two tokens at positions 4-5
    start = next(i for i in range(len(plain) - 1) if plain[i : i + 2] == word)  # where greedy writes it first
    got = _generate(engine, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, bad_words_token_ids=[word]))
    assert got[: start + 1] == plain[: start + 1]  # the first token of the word is still allowed
    assert got[start + 1] != plain[start + 1]  # its completion is not
    assert all(got[i : i + 2] != word for i in range(len(got) - 1))


def test_cache_salt_separates_prefix_cache_chains(engine: Engine) -> None:
    prompt = list(range(3, 40))

    def cached(salt: str | None) -> int:
        engine.add_request("s", prompt, SamplingParams(max_tokens=1, cache_salt=salt))
        return run(engine)[("s", 0)][-1].num_cached_tokens

    assert cached(None) == 0
    assert cached(None) > 0
    assert cached("a") == 0  # a salted request never hits the unsalted chain
    assert cached("a") > 0
    assert cached("b") == 0


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[]).validate(256)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[300]).validate(256)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words_token_ids=[[]]).validate(256)
