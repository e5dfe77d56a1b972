"""`--reasoning-parser`: a reasoning model's thinking goes to `reasoning_content`, its answer to `content`.

    deepseek_r1  <think> ... </think> answer   the template opens <think>, so text before </think> is reasoning
                                               even without the opening tag; no </think> yet = all reasoning
    qwen3        <think> ... </think> answer   reasoning only when the output opens <think> (enable_thinking=false
                                               renders an empty think block into the prompt: all content)
    mistral      [THINK] ... [/THINK] answer   as qwen3, with Magistral's tags

The splitter works on streamed text: a tag split across chunks is held back until it is whole (or
proven not to be one), so no tag byte ever reaches the client.
"""

from __future__ import annotations

from dataclasses import dataclass

_BEFORE, _REASONING, _CONTENT = "before", "reasoning", "content"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    start: str
    end: str
    starts_in_reasoning: bool  # the prompt already opened the reasoning block


PARSERS = {
    "deepseek_r1": ReasoningFormat("<think>", "</think>", starts_in_reasoning=True),
    "qwen3": ReasoningFormat("<think>", "</think>", starts_in_reasoning=False),
    "mistral": ReasoningFormat("[THINK]", "[/THINK]", starts_in_reasoning=False),
}


def _held_back(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag` (so must wait for more text)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """One choice's text, split as it streams: `feed` returns (reasoning, content) ready to send."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.state = _BEFORE
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, content = "", ""
        if self.state == _BEFORE:
            stripped = self.pending.lstrip()
            if stripped.startswith(self.fmt.start):
                self.pending, self.state = stripped[len(self.fmt.start) :], _REASONING
            elif self.fmt.start.startswith(stripped):
                return "", ""  # empty, or the tag's beginning: wait
            else:
                self.state = _REASONING if self.fmt.starts_in_reasoning else _CONTENT
        if self.state == _REASONING:
            before, found, after = self.pending.partition(self.fmt.end)
            if found:
                reasoning, self.pending, self.state = before, after, _CONTENT
            else:
                keep = _held_back(self.pending, self.fmt.end)
                cut = len(self.pending) - keep
                return self.pending[:cut], self._keep(self.pending[cut:])
        if self.state == _CONTENT:
            content, self.pending = self.pending, ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """The end of the output: what was held back, as what it turned out to be."""
        rest, self.pending = self.pending, ""
        if self.state == _REASONING or (self.state == _BEFORE and self.fmt.starts_in_reasoning):
            return rest, ""
        return "", rest

    def _keep(self, held: str) -> str:
        self.pending = held
        return ""


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str | None]:
    """A whole output as (reasoning_content, content), None for an empty part (vLLM's non-streamed shape)."""
    splitter = ReasoningSplitter(fmt)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.flush()
    reasoning, content = reasoning + more_reasoning, content + more_content
    return reasoning or None, content or None
