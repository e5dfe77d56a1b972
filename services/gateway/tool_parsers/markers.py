"""Splitting streamed text on markup: the one piece of tool-call parsing that must see across chunks.

A family's markup is a set of literal markers (`<tool_call>`, `[TOOL_CALLS]`, `<|channel|>` ...). Text
arrives in pieces cut anywhere, so a marker may straddle two pieces. `MarkerSplitter.feed` returns the
pieces of text and the markers found, holding back any end of the text that could still grow into a
marker; which markers count is asked anew after each one (a parser's state decides what it looks for).
The result is the same however the text was cut.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `markers`."""
    longest = min(max((len(m) for m in markers), default=1) - 1, len(text))
    for size in range(longest, 0, -1):
        end = text[-size:]
        if any(m.startswith(end) and m != end for m in markers):
            return size
    return 0


@dataclass(slots=True)
class MarkerSplitter:
    """Text in, ("text", piece) / ("marker", marker) out; `markers()` names what to look for right now."""

    markers: Callable[[], tuple[str, ...]]
    _pending: str = ""

    def feed(self, text: str, is_last: bool = False) -> Iterator[tuple[str, str]]:
        buffer, self._pending = self._pending + text, ""
        while buffer:
            markers = self.markers()
            hold = 0 if is_last else partial_suffix(buffer, markers)
            found = _first_marker(buffer, markers)
            # A marker counts only if no longer one could still begin before it.
            if found is not None and found[0] <= len(buffer) - hold:
                at, marker = found
                if at:
                    yield "text", buffer[:at]
                buffer = buffer[at + len(marker) :]
                yield "marker", marker
                continue
            ready = buffer[: len(buffer) - hold]
            self._pending = buffer[len(ready) :]
            if ready:
                yield "text", ready
            return


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest marker in `text` (the longest one where two begin at the same place)."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = text.find(marker) if marker else -1
        if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(marker) > len(best[1]))):
            best = (at, marker)
    return best
