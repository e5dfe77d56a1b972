"""min_characters on the engine side: characters per token from the tokenizer, and a request whose EOS stays
masked (and is no stop) until its output's text is long enough."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.token_chars import TokenChars
from tests.engine.engine_helpers import make_request

EOS = 2


def test_lengths_are_the_decoded_text_and_special_tokens_count_nothing(smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    vocab = len(tokenizer) + 5  # a model's vocabulary may be padded past the tokenizer's
    lengths = TokenChars(smollm2_dir, vocab).lengths
    assert len(lengths) == vocab and lengths[-5:] == [0] * 5
    for token_id in tokenizer(" Paris is lovely")["input_ids"]:
        assert lengths[token_id] == len(tokenizer.decode([token_id])) > 0
    assert lengths[tokenizer.eos_token_id] == 0


def test_eos_is_masked_and_no_stop_until_the_text_is_long_enough() -> None:
    request = make_request([5, 6], SamplingParams(max_tokens=16, min_characters=5), eos_token_ids=frozenset({EOS}))
    request.token_chars = [0, 0, 0, 2, 3]  # token 3: two characters, token 4: three
    request.all_token_ids.append(3)
    assert request.is_min_tokens_pending and request.stop_reason_after(EOS, 1024) is None
    request.all_token_ids.append(4)  # 2 + 3 characters
    assert not request.is_min_tokens_pending and request.stop_reason_after(EOS, 1024) == "stop"
    plain = make_request([5, 6], SamplingParams(max_tokens=16), eos_token_ids=frozenset({EOS}))
    assert not plain.is_min_tokens_pending and plain.stop_reason_after(EOS, 1024) == "stop"
