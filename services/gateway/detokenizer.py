"""Per-choice text: incremental detokenization (never broken UTF-8) and stop strings (shared/stop_rule.py).

`tokenizers`' DecodeStream holds back bytes until they form whole characters. Stop strings are
matched on the text; the last `longest_stop - 1` characters are held back while streaming so a
stop string split across tokens is never half-sent. The last token flushes both: bytes that never
formed a character end the text as U+FFFD, as decoding the whole output would give (a choice made
only of such bytes, e.g. a random model repeating a lone UTF-8 lead byte, is not left empty).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizers.decoders import DecodeStream

from pagedserve.shared.stop_rule import find_stop_string, held_back

_CONTEXT_TOKENS = 6  # prompt tokens fed first, so the first output token gets its leading space right


@dataclass(slots=True)
class TextDelta:
    text: str
    finish_reason: str | None  # "stop" when a stop string ended the choice here


@dataclass(frozen=True, slots=True)
class TextOptions:
    """How a request's choices become text (vLLM's detokenization fields)."""

    include_stop_str: bool = False
    skip_special_tokens: bool = True


@dataclass(slots=True)
class ChoiceText:
    tokenizer: Any  # a transformers fast tokenizer
    prompt_token_ids: list[int]
    stop_strings: list[str]
    text: str = ""
    num_sent: int = 0  # characters of `text` already sent
    is_stopped: bool = False
    stop_string: str | None = None  # the stop string that ended the choice (vLLM's stop_reason)
    stop_token_id: int | None = None  # or the request's stop token (stop_token_ids) that did
    token_ids: list[int] = field(default_factory=list)
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output: the text ends with the stop string
    skip_special_tokens: bool = True
    _stream: Any = None
    _num_held: int = 0  # trailing tokens the stream has not turned into text yet (bytes of no whole character)

    def __post_init__(self) -> None:
        self._stream = DecodeStream(
            ids=self.prompt_token_ids[-_CONTEXT_TOKENS:], skip_special_tokens=self.skip_special_tokens
        )

    def add(self, token_ids: list[int], is_last: bool) -> TextDelta:
        """Text that may be sent now for these new tokens; `is_last` flushes what was held back."""
        backend = self.tokenizer.backend_tokenizer
        for token_id in token_ids:
            self.token_ids.append(token_id)
            piece = self._stream.step(backend, token_id)
            if piece:
                self.text += piece
                self._num_held = 0
            else:
                self._num_held += 1
        if is_last and self._num_held and not self.is_stopped:
            self.text += self._held_bytes_text(backend)
            self._num_held = 0
        if self.stop_strings and not self.is_stopped:
            found = self._find_stop()
            if found is not None:
                cut, self.stop_string = found
                end = cut + len(self.stop_string) if self.include_stop_str else cut
                self.text, self.is_stopped = self.text[:end], True
        hold = 0 if (is_last or self.is_stopped) else held_back(self.stop_strings)
        end = max(self.num_sent, len(self.text) - hold)
        delta = self.text[self.num_sent : end]
        self.num_sent = end
        return TextDelta(delta, "stop" if self.is_stopped else None)

    def _held_bytes_text(self, backend: Any) -> str:
        """The held tokens' text, bytes of no whole character as U+FFFD: decoded after a few tokens before them
        (as the stream decodes, so a leading space comes out right), only those: O(held), not O(output)."""
        ids = (self.prompt_token_ids[-_CONTEXT_TOKENS:] + self.token_ids)[-(self._num_held + _CONTEXT_TOKENS) :]
        before = ids[: -self._num_held]
        skip = self.skip_special_tokens
        whole, prefix = backend.decode(ids, skip_special_tokens=skip), backend.decode(before, skip_special_tokens=skip)
        return whole[len(prefix) :] if whole.startswith(prefix) else ""

    def _find_stop(self) -> tuple[int, str] | None:
        """(where the first stop string begins, which one), or None."""
        longest = max(len(s) for s in self.stop_strings)
        start = max(0, self.num_sent - longest)  # a stop may begin in text held back earlier
        return find_stop_string(self.text, self.stop_strings, start)
