"""Per-choice text: incremental detokenization (never broken UTF-8) and stop strings.

`tokenizers`' DecodeStream holds back bytes until they form whole characters. Stop strings are
matched on the text; the last `longest_stop - 1` characters are held back while streaming so a
stop string split across tokens is never half-sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizers.decoders import DecodeStream

_CONTEXT_TOKENS = 6  # prompt tokens fed first, so the first output token gets its leading space right


@dataclass(slots=True)
class TextDelta:
    text: str
    finish_reason: str | None  # "stop" when a stop string ended the choice here


@dataclass(slots=True)
class ChoiceText:
    tokenizer: Any  # a transformers fast tokenizer
    prompt_token_ids: list[int]
    stop_strings: list[str]
    text: str = ""
    num_sent: int = 0  # characters of `text` already sent
    is_stopped: bool = False
    token_ids: list[int] = field(default_factory=list)
    _stream: Any = None

    def __post_init__(self) -> None:
        self._stream = DecodeStream(ids=self.prompt_token_ids[-_CONTEXT_TOKENS:], skip_special_tokens=True)

    def add(self, token_ids: list[int], is_last: bool) -> TextDelta:
        """Text that may be sent now for these new tokens; `is_last` flushes what was held back."""
        backend = self.tokenizer.backend_tokenizer
        for token_id in token_ids:
            self.token_ids.append(token_id)
            piece = self._stream.step(backend, token_id)
            if piece:
                self.text += piece
        if self.stop_strings and not self.is_stopped:
            cut = self._find_stop()
            if cut is not None:
                self.text, self.is_stopped = self.text[:cut], True
        hold = 0 if (is_last or self.is_stopped) else max((len(s) for s in self.stop_strings), default=1) - 1
        end = max(self.num_sent, len(self.text) - hold)
        delta = self.text[self.num_sent:end]
        self.num_sent = end
        return TextDelta(delta, "stop" if self.is_stopped else None)

    def _find_stop(self) -> int | None:
        longest = max(len(s) for s in self.stop_strings)
        start = max(0, self.num_sent - longest)  # a stop may begin in text held back earlier
        hits = [i for s in self.stop_strings if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None
