"""The text and the raw bytes of single tokens, for logprobs.

A token may be part of a multi-byte character (one emoji = several byte-level tokens): its text
alone decodes to U+FFFD, but OpenAI's `bytes` field carries the token's real bytes so that a
client can join them. Byte-level BPE vocabularies (GPT-2 style) spell each byte as one printable
character; SentencePiece ones have `<0xNN>` byte-fallback tokens and `▁` for a space.
"""

from __future__ import annotations

import functools
from typing import Any

from tokenizers.decoders import ByteLevel


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode table."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class TokenTexts:
    """Per-tokenizer token -> (text, bytes), cached (the vocabulary is fixed)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.is_byte_level = isinstance(getattr(backend, "decoder", None), ByteLevel)
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []))
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = str(self.tokenizer.decode([token_id]))
            hit = self._cache[token_id] = (text, self._bytes(token_id, text))
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def _bytes(self, token_id: int, text: str) -> list[int]:
        if token_id in self.special_ids:
            return list(text.encode())
        piece = str(self.tokenizer.convert_ids_to_tokens(token_id))
        if self.is_byte_level:
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return [table[c] for c in piece]
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return [int(piece[3:5], 16)]
        return list(text.encode())
