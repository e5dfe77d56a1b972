"""`--reasoning-parser`: a reasoning model's thinking goes to `reasoning_content`, its answer to `content`.

    deepseek_r1  <think> ... </think> answer   the template opens <think>, so text before </think> is reasoning
                                               even without the opening tag; no </think> yet = all reasoning
    qwen3        <think> ... </think> answer   reasoning only when the output opens <think> (enable_thinking=false
                                               renders an empty think block into the prompt: all content)
    mistral      [THINK] ... [/THINK] answer   as qwen3, with Magistral's tags
    granite      Here is my thought process: ... Here is my response: answer   (or "Here's"), as vLLM's
    gpt_oss      harmony channels: analysis = reasoning, final = answer (reasoning_harmony.py); `openai` too

The splitter works on streamed text: a marker split across chunks is held back until it is whole (or
proven not to be one), so no marker byte ever reaches the client.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

from pagedserve.services.gateway.detokenizer import TextOptions
from pagedserve.services.gateway.reasoning_harmony import HarmonySplitter

_BEFORE, _REASONING, _CONTENT = "before", "reasoning", "content"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    starts: tuple[str, ...]  # markers that open the reasoning (any one)
    ends: tuple[str, ...]  # markers that end it and start the answer (any one)
    starts_in_reasoning: bool  # the prompt already opened the reasoning block
    is_harmony: bool = False  # gpt-oss channels rather than start/end markers
    keeps_special_tokens: bool = False  # the markers are special tokens: detokenize without skipping them

    def grammar_markers(self) -> dict[str, list[str]]:
        """The reasoning's openers and closers as text, for the engine's grammar gate (a grammar applies after)."""
        if self.is_harmony:  # the analysis channel is the reasoning, the final channel the answer
            return {"starts": ["<|channel|>analysis<|message|>"], "ends": ["<|channel|>final<|message|>"]}
        return {"starts": list(self.starts), "ends": list(self.ends)}


PARSERS = {
    "deepseek_r1": ReasoningFormat(("<think>",), ("</think>",), starts_in_reasoning=True),
    "qwen3": ReasoningFormat(("<think>",), ("</think>",), starts_in_reasoning=False),
    "mistral": ReasoningFormat(("[THINK]",), ("[/THINK]",), starts_in_reasoning=False),
    "granite": ReasoningFormat(
        ("Here is my thought process:", "Here's my thought process:"),
        ("Here is my response:", "Here's my response:"),
        starts_in_reasoning=False,
    ),
    "gpt_oss": ReasoningFormat((), (), False, is_harmony=True, keeps_special_tokens=True),
}
PARSERS["openai"] = PARSERS["gpt_oss"]  # vLLM's other name for it


class Splitter(Protocol):
    @property
    def is_answering(self) -> bool: ...
    def feed(self, text: str) -> tuple[str, str]: ...
    def flush(self) -> tuple[str, str]: ...


def new_splitter(fmt: ReasoningFormat) -> Splitter:
    return HarmonySplitter() if fmt.is_harmony else ReasoningSplitter(fmt)


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could be the start of a marker (so must wait for more text)."""
    for size in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(marker.startswith(text[-size:]) for marker in markers):
            return size
    return 0


def _first_of(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(at, marker) for marker in markers if (at := text.find(marker)) >= 0]
    return min(found) if found else None


class ReasoningSplitter:
    """One choice's text, split as it streams: `feed` returns (reasoning, content) ready to send."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.state = _BEFORE
        self.pending = ""

    @property
    def is_answering(self) -> bool:
        return self.state == _CONTENT

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, content = "", ""
        if self.state == _BEFORE:
            stripped = self.pending.lstrip()
            start = next((s for s in self.fmt.starts if stripped.startswith(s)), None)
            if start is not None:
                self.pending, self.state = stripped[len(start) :], _REASONING
            elif any(s.startswith(stripped) for s in self.fmt.starts):
                return "", ""  # empty, or a marker's beginning: wait
            else:
                self.state = _REASONING if self.fmt.starts_in_reasoning else _CONTENT
        if self.state == _REASONING:
            found = _first_of(self.pending, self.fmt.ends)
            if found is not None:
                at, end = found
                reasoning, self.pending, self.state = self.pending[:at], self.pending[at + len(end) :], _CONTENT
            else:
                cut = len(self.pending) - _held_back(self.pending, self.fmt.ends)
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
        if self.state == _CONTENT:
            content, self.pending = self.pending, ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """The end of the output: what was held back, as what it turned out to be."""
        rest, self.pending = self.pending, ""
        if self.state == _REASONING or (self.state == _BEFORE and self.fmt.starts_in_reasoning):
            return rest, ""
        return "", rest


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str | None]:
    """A whole output as (reasoning_content, content), None for an empty part (vLLM's non-streamed shape)."""
    splitter = new_splitter(fmt)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.flush()
    reasoning, content = reasoning + more_reasoning, content + more_content
    return reasoning or None, content or None


def count_reasoning_tokens(fmt: ReasoningFormat, tokenizer: Any, token_ids: list[int]) -> int:
    """How many of a choice's tokens came before its answer began (the reasoning, its markers included):
    `usage.completion_tokens_details.reasoning_tokens`. The answer begins at the first token whose text
    completes the end marker, found by bisection over decoded prefixes (a splitter only moves forward)."""
    skip = not fmt.keeps_special_tokens

    def is_answering(num_tokens: int) -> bool:
        splitter = new_splitter(fmt)
        splitter.feed(tokenizer.decode(token_ids[:num_tokens], skip_special_tokens=skip))
        return splitter.is_answering

    if split_reasoning(fmt, tokenizer.decode(token_ids, skip_special_tokens=skip))[0] is None:
        return 0  # no reasoning at all
    low, high = 0, len(token_ids)  # the answer has not begun after `low` tokens; maybe after `high`
    if not is_answering(high):
        return high  # all reasoning (cut by max_tokens, or no end marker)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if is_answering(middle) else (middle, high)
    return high


def add_reasoning_tokens(usage: dict[str, Any], fmt: ReasoningFormat, choices: list[Any]) -> dict[str, Any]:
    """`usage` with completion_tokens_details.reasoning_tokens, over every choice (detokenizer.ChoiceText)."""
    num_tokens = sum(count_reasoning_tokens(fmt, c.tokenizer, c.token_ids) for c in choices)
    usage["completion_tokens_details"] = {**usage.get("completion_tokens_details", {}), "reasoning_tokens": num_tokens}
    return usage


def gate_grammar(sampling: Any, fmt: ReasoningFormat | None, in_reasoning: bool) -> None:
    """A request with a grammar under a reasoning parser: the grammar waits for the reasoning to end (vLLM's
    default), unless `--grammar-in-reasoning`. The tokenizer turns the markers into token ids."""
    if fmt is not None and not in_reasoning and sampling.get("structured_output") is not None:
        sampling["reasoning_markers"] = fmt.grammar_markers()


def text_options_for(fmt: ReasoningFormat | None, options: TextOptions) -> TextOptions:
    """A request's detokenization under the parser: harmony's markers are special tokens, so they are kept."""
    return replace(options, skip_special_tokens=False) if fmt is not None and fmt.keeps_special_tokens else options
