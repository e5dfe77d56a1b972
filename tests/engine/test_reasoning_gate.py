"""The reasoning gate: where the prompt leaves the reasoning (open, closed, none), and end markers of one or
several tokens completed by the output."""

from __future__ import annotations

from pagedserve.services.engine.structured.reasoning_gate import PROMPT_TAIL, ReasoningGate

THINK, END_THINK = [7], [8]  # one special token each, as <think> and </think> in Qwen3
HARMONY_FINAL = [20, 21, 22]  # <|channel|> final <|message|>


def test_where_the_prompt_leaves_the_reasoning() -> None:
    def opened(prompt: list[int]) -> bool:
        return ReasoningGate.for_prompt([THINK], [END_THINK], prompt).is_open

    assert not opened([1, 2, 3])  # no markers: the model may reason first (Qwen3 with thinking on)
    assert not opened([1, 2, *THINK, 4])  # DeepSeek-R1's template opens the block: reasoning runs
    assert opened([1, 2, *THINK, 4, *END_THINK, 5])  # enable_thinking=false: an empty block, closed
    assert not opened([1, *END_THINK, 2, *THINK, 3])  # an earlier block closed, this turn's opened
    old_turn = [1, *THINK, 2, *END_THINK] + [3] * PROMPT_TAIL  # only the tail is read: an old turn doesn't count
    assert not opened(old_turn)


def test_a_multi_token_end_marker_opens_the_gate_on_its_last_token() -> None:
    gate = ReasoningGate.for_prompt([], [HARMONY_FINAL, [9]], [1, 2])
    for token in [5, 20, 21, 6, 20, 21]:  # a partial marker, broken off, then again
        gate.feed(token)
        assert not gate.is_open
    gate.feed(22)
    assert gate.is_open
    gate.feed(20)  # once open, it stays open
    assert gate.is_open
    single = ReasoningGate.for_prompt([], [HARMONY_FINAL, [9]], [])
    single.feed(9)  # any one of the end markers
    assert single.is_open
