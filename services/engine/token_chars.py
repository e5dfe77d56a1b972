"""Characters per token id, for `min_characters`: EOS and stop tokens stay masked until the output's text
is that long. Built once, on the first request that asks, from the model's tokenizer (special tokens count
0, as the text shown skips them). A token that holds part of a multi-byte character counts its replacement
character, so a text of such pieces can read a little longer than it is."""

from __future__ import annotations

from pathlib import Path

from pagedserve.shared.tokenizer_loader import load_tokenizer


class TokenChars:
    def __init__(self, tokenizer_source: str | Path, vocab_size: int) -> None:
        self.tokenizer_source, self.vocab_size = tokenizer_source, vocab_size
        self._lengths: list[int] | None = None

    @property
    def lengths(self) -> list[int]:
        """Per token id (the model's vocabulary; ids the tokenizer lacks count 0)."""
        if self._lengths is None:
            tokenizer = load_tokenizer(self.tokenizer_source)
            ids = range(min(len(tokenizer), self.vocab_size))
            texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=True)
            self._lengths = [len(t) for t in texts] + [0] * (self.vocab_size - len(ids))
        return self._lengths
