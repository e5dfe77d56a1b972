"""Reasoning parsers: whole outputs, and the same outputs streamed in every possible split."""

from __future__ import annotations

import random

import pytest

from pagedserve.services.gateway.reasoning import (
    PARSERS,
    ReasoningFormat,
    ReasoningSplitter,
    count_reasoning_tokens,
    gate_grammar,
    new_splitter,
    split_reasoning,
)
from pagedserve.services.gateway.reasoning_harmony import HarmonySplitter
from pagedserve.shared.config import REASONING_PARSERS

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
    ("granite", "Here is my thought process:\n2+2 is 4.\nHere is my response:\n4", ("\n2+2 is 4.\n", "\n4")),
    ("granite", "Here's my thought process: sum. Here's my response: 4", (" sum. ", " 4")),
    ("granite", "Four.", (None, "Four.")),  # thinking off: no markers
    ("granite", "Here is my thought process: cut by max_tokens", (" cut by max_tokens", None)),
    (
        "gpt_oss",
        "<|channel|>analysis<|message|>User asks <b>capital</b>.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Paris.",
        ("User asks <b>capital</b>.", "Paris."),
    ),
    ("gpt_oss", "<|channel|>analysis<|message|>cut by max_tokens", ("cut by max_tokens", None)),
    ("gpt_oss", "<|channel|>final<|message|>Only an answer.<|return|>", (None, "Only an answer.")),
    ("gpt_oss", "no harmony at all", (None, "no harmony at all")),
    (  # a tool call (commentary) stays whole in the content, for a harmony tool-call parser
        "gpt_oss",
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
        (
            "Need weather.",
            '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":'
            '"Paris"}<|call|>',
        ),
    ),
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
            splitter = new_splitter(PARSERS[parser])
            parts = [splitter.feed(piece) for piece in (output[:i], output[i:j], output[j:])] + [splitter.flush()]
            reasoning = "".join(r for r, _ in parts) or None
            content = "".join(c for _, c in parts) or None
            assert (reasoning, content) == expected, (i, j)  # so no tag byte went out in any part


def test_reasoning_is_sent_as_it_comes() -> None:
    splitter = ReasoningSplitter(PARSERS["qwen3"])
    assert splitter.feed("<think>first idea") == ("first idea", "")
    assert splitter.feed(" and more </thi") == (" and more ", "")  # the tag's start waits
    assert splitter.feed("nk>answer") == ("", "answer")


@pytest.mark.parametrize(("parser", "output", "expected"), CASES)
def test_random_chunkings_stream_the_same(parser: str, output: str, expected: tuple[str | None, str | None]) -> None:
    rng = random.Random(parser + output)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(output) + 1), rng.randint(1, min(12, len(output) + 1))))
        pieces = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])]
        splitter = new_splitter(PARSERS[parser])
        parts = [splitter.feed(piece) for piece in pieces] + [splitter.flush()]
        assert ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None) == expected, pieces


def test_every_parser_is_a_choice_of_the_flag() -> None:
    assert set(PARSERS) == set(REASONING_PARSERS)


def test_reasoning_tokens_are_those_before_the_answer(smollm2_dir: object) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    thought = tokenizer.encode("<think>Paris is in France.</think>", add_special_tokens=False)
    answer = tokenizer.encode("Paris.", add_special_tokens=False)
    assert count_reasoning_tokens(PARSERS["qwen3"], tokenizer, thought + answer) == len(thought)
    assert count_reasoning_tokens(PARSERS["qwen3"], tokenizer, answer) == 0  # no reasoning
    assert count_reasoning_tokens(PARSERS["deepseek_r1"], tokenizer, answer) == len(answer)  # never closed
    granite = tokenizer.encode("Here is my thought process: sum. Here is my response:", add_special_tokens=False)
    assert count_reasoning_tokens(PARSERS["granite"], tokenizer, granite + answer) == len(granite)


def test_harmony_answers_once_a_final_message_begins() -> None:
    splitter = HarmonySplitter()
    assert splitter.feed("<|channel|>analysis<|message|>think<|en") == ("think", "")  # the marker's start waits
    assert not splitter.is_answering
    assert splitter.feed("d|><|start|>assistant<|channel|>final<|message|>Hi") == ("", "Hi")
    assert splitter.is_answering


def test_a_grammar_waits_for_the_reasoning_unless_asked_otherwise() -> None:
    grammar = {"kind": "regex", "value": "[0-9]+"}
    sampling: dict[str, object] = {"structured_output": grammar}
    gate_grammar(sampling, PARSERS["qwen3"], in_reasoning=False)
    assert sampling["reasoning_markers"] == {"starts": ["<think>"], "ends": ["</think>"]}
    harmony: dict[str, object] = {"structured_output": grammar}
    gate_grammar(harmony, PARSERS["gpt_oss"], in_reasoning=False)
    assert harmony["reasoning_markers"] == {
        "starts": ["<|channel|>analysis<|message|>"],
        "ends": ["<|channel|>final<|message|>"],
    }
    cases: list[tuple[dict[str, object], ReasoningFormat | None, bool]] = [
        ({"structured_output": grammar}, PARSERS["qwen3"], True),  # --grammar-in-reasoning: from the first token
        ({"structured_output": None}, PARSERS["qwen3"], False),  # no grammar: nothing to hold
        ({"structured_output": grammar}, None, False),  # no reasoning parser
    ]
    for unchanged, fmt, in_reasoning in cases:
        gate_grammar(unchanged, fmt, in_reasoning)
        assert "reasoning_markers" not in unchanged
