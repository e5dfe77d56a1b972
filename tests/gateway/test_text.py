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


def test_bytes_that_never_form_a_character_end_the_text_as_replacement_characters(tokenizer: Any) -> None:
    """A lone UTF-8 lead byte repeated (what a random-weight model may generate) is held back while streaming
    and flushed at the last token as decoding the whole output gives it: the choice is never left empty."""
    lead_byte = tokenizer.convert_tokens_to_ids("â")  # byte-level BPE's token for the byte 0xE2 alone
    ids = tokenizer.encode("ok") + [lead_byte] * 3
    choice = ChoiceText(tokenizer, tokenizer.encode("Say:"), [])
    deltas = feed(choice, ids)
    assert deltas[-1] and "\ufffd" in deltas[-1]
    assert "".join(deltas) == tokenizer.decode(ids) == "ok" + tokenizer.decode([lead_byte] * 3)
