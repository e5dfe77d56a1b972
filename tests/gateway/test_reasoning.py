"""Reasoning parsers: whole outputs, and the same outputs streamed in every possible split."""

from __future__ import annotations

import pytest

from pagedserve.services.gateway.reasoning import PARSERS, ReasoningSplitter, split_reasoning

CASES = [  # parser, output, (reasoning, content)
    (
        "deepseek_r1",
        "<think>Paris is the capital.</think>The capital is Paris.",
        ("Paris is the capital.", "The capital is Paris."),
    ),
    # the template opened <think> in the prompt:
    ("deepseek_r1", "Paris is the capital.</think>\n\nParis.", ("Paris is the capital.", "\n\nParis.")),
    ("deepseek_r1", "still thinking, cut by max_tokens", ("still thinking, cut by max_tokens", None)),
    ("qwen3", "<think>\nhmm\n</think>\n\nFour.", ("\nhmm\n", "\n\nFour.")),
    ("qwen3", "Four.", (None, "Four.")),  # enable_thinking=false: no tags in the output
    ("qwen3", "\n<think>x < y</think>so x", ("x < y", "so x")),
    ("qwen3", "a <think> in the answer", (None, "a <think> in the answer")),  # only a leading tag opens
    ("mistral", "[THINK]2+2[/THINK]4", ("2+2", "4")),
    ("qwen3", "<think></think>", (None, None)),
]


@pytest.mark.parametrize(("parser", "output", "expected"), CASES)
def test_whole_outputs(parser: str, output: str, expected: tuple[str | None, str | None]) -> None:
    assert split_reasoning(PARSERS[parser], output) == expected


@pytest.mark.parametrize(("parser", "output", "expected"), CASES)
def test_every_two_and_three_way_split_streams_the_same(
    parser: str, output: str, expected: tuple[str | None, str | None]
) -> None:
    for i in range(len(output) + 1):
        for j in range(i, len(output) + 1):
            splitter = ReasoningSplitter(PARSERS[parser])
            parts = [splitter.feed(piece) for piece in (output[:i], output[i:j], output[j:])] + [splitter.flush()]
            reasoning = "".join(r for r, _ in parts) or None
            content = "".join(c for _, c in parts) or None
            assert (reasoning, content) == expected, (i, j)  # so no tag byte went out in any part


def test_reasoning_is_sent_as_it_comes() -> None:
    splitter = ReasoningSplitter(PARSERS["qwen3"])
    assert splitter.feed("<think>first idea") == ("first idea", "")
    assert splitter.feed(" and more </thi") == (" and more ", "")  # the tag's start waits
    assert splitter.feed("nk>answer") == ("", "answer")
