"""Token texts and bytes for logprobs, and per-choice incremental text with stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from pagedserve.services.gateway.detokenizer import ChoiceText
from pagedserve.services.gateway.token_text import TokenTexts

TEXT = "Héllo 😀 wörld, the end."


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_token_bytes_join_to_the_utf8_text_even_inside_a_character(tokenizer: Any) -> None:
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(TEXT)
    pieces = [texts.get(i) for i in ids]
    assert any(text == "\ufffd" or text.endswith("\ufffd") for text, _ in pieces), "the emoji spans tokens"
    assert b"".join(bytes(raw) for _, raw in pieces).decode() == TEXT
    eos_text, eos_bytes = texts.get(tokenizer.eos_token_id)
    assert eos_text == tokenizer.eos_token and bytes(eos_bytes) == eos_text.encode()


def feed(choice: ChoiceText, ids: list[int]) -> list[str]:
    return [choice.add([t], is_last=i == len(ids) - 1).text for i, t in enumerate(ids)]


def test_text_arrives_whole_and_matches_decode(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    choice = ChoiceText(tokenizer, tokenizer.encode("Say:"), [])
    deltas = feed(choice, ids)
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert len([d for d in deltas if d]) > 3


@pytest.mark.parametrize("stop", ["wörld", "ld, t", " the end", "Hé"])
def test_a_stop_string_cuts_before_it_even_across_tokens(tokenizer: Any, stop: str) -> None:
    ids = tokenizer.encode(TEXT)
    choice = ChoiceText(tokenizer, [], ["never", stop])
    sent = ""
    for i, t in enumerate(ids):
        delta = choice.add([t], is_last=i == len(ids) - 1)
        sent += delta.text
        assert stop not in sent and TEXT.startswith(sent)  # never a half stop string, never wrong text
        if delta.finish_reason == "stop":
            break
    assert choice.is_stopped and sent == TEXT[: TEXT.index(stop)]


def test_without_a_match_everything_held_back_is_flushed_at_the_end(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT)
    choice = ChoiceText(tokenizer, [], ["a much longer stop string"])
    deltas = feed(choice, ids)
    assert "".join(deltas) == TEXT and not choice.is_stopped
    assert deltas[0] == "", "the start could still begin the stop string, so it is held back"
