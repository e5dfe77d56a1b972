"""A grammar held back while the model reasons (vLLM's default with a reasoning parser): tokens pass free
until the output completes one of the reasoning's end markers, and the grammar constrains what follows.

A prompt that already closed its reasoning block starts the grammar at once: Qwen3's template with
enable_thinking=false renders an empty `<think></think>` at its end. Only the prompt's tail is read, as the
current turn's opener sits there (earlier turns' reasoning must not count).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

PROMPT_TAIL = 64  # tokens of the prompt where the generation prompt's markers are looked for


def _last_at(ids: Sequence[int], marker: Sequence[int]) -> int:
    """Where the last occurrence of `marker` ends in `ids`, or -1."""
    size = len(marker)
    for end in range(len(ids), size - 1, -1):
        if list(ids[end - size : end]) == list(marker):
            return end
    return -1


@dataclass(slots=True)
class ReasoningGate:
    ends: list[list[int]]
    is_open: bool = False  # the reasoning is over: the grammar applies
    _tail: list[int] = field(default_factory=list)  # the last output tokens, enough to hold an end marker

    @classmethod
    def for_prompt(cls, starts: list[list[int]], ends: list[list[int]], prompt: Sequence[int]) -> ReasoningGate:
        tail = prompt[-PROMPT_TAIL:]
        last_end = max((_last_at(tail, marker) for marker in ends), default=-1)
        last_start = max((_last_at(tail, marker) for marker in starts), default=-1)
        return cls([list(m) for m in ends if m], is_open=last_end >= 0 and last_end > last_start)

    def feed(self, token_id: int) -> None:
        """Follow one output token while the reasoning runs; opens the gate when an end marker completes."""
        if self.is_open:
            return
        self._tail.append(token_id)
        longest = max((len(m) for m in self.ends), default=0)
        del self._tail[: max(0, len(self._tail) - longest)]
        self.is_open = any(self._tail[len(self._tail) - len(m) :] == m for m in self.ends if len(m) <= len(self._tail))
