"""Unknown request fields that were ignored: one log line per field name, and a response header.

Real clients send fields of newer OpenAI APIs (or of other servers); like vLLM the gateway ignores
them, but says so: `X-Ignored-Fields: a, messages[0].b` on the response, and a warning the first
time a name is seen. Names come from clients, so both are bounded and reduced to plain ASCII.
"""

from __future__ import annotations

import logging
import re
import time

log = logging.getLogger(__name__)

HEADER = "x-ignored-fields"
_MAX_NAMES_IN_HEADER = 16
_MAX_NAME_CHARS = 64
_MAX_REMEMBERED = 1024  # distinct names warned about; past that, one summary line a minute
_SUMMARY_EVERY_S = 60.0
_UNSAFE = re.compile(r"[^\x21-\x7e]|,")  # no spaces, controls, non-ASCII or commas in a header item


def printable(name: str) -> str:
    return _UNSAFE.sub("?", name[:_MAX_NAME_CHARS])


def header_value(names: list[str]) -> str:
    shown = [printable(n) for n in names[:_MAX_NAMES_IN_HEADER]]
    if len(names) > _MAX_NAMES_IN_HEADER:
        shown.append(f"... ({len(names) - _MAX_NAMES_IN_HEADER} more)")
    return ", ".join(shown)


class IgnoredFieldsLog:
    """Warns once per field name (paths collapse to their names: `messages[3].x` and `messages[0].x`
    are one), so a client that always sends a field costs one line, not one per request."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._last_summary = float("-inf")
        self._num_unlogged = 0

    def warn(self, route: str, paths: list[str]) -> None:
        new = sorted({printable(re.sub(r"\[\d+\]", "[]", p)) for p in paths} - self._seen)
        if not new:
            return
        room = _MAX_REMEMBERED - len(self._seen)
        if room > 0:
            self._seen.update(new[:room])
            log.warning(
                "ignored unknown request field(s) on %s: %s (logged once per name; "
                "--strict-request-fields refuses them)",
                route,
                ", ".join(new[:room]),
            )
            new = new[room:]
        self._num_unlogged += len(new)
        now = time.monotonic()
        if self._num_unlogged and now - self._last_summary >= _SUMMARY_EVERY_S:
            log.warning(
                "ignored %d more unknown request field name(s) (no longer listed one by one)", self._num_unlogged
            )
            self._last_summary, self._num_unlogged = now, 0
