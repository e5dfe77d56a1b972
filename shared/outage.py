"""Logging a Redis outage without a flood: one warning when it starts, a reminder at most every `every_s`
while it lasts, and one line when it ends, however many operations fail meanwhile."""

from __future__ import annotations

import logging
import time


class OutageLog:
    def __init__(self, log: logging.Logger, every_s: float = 10.0) -> None:
        self.log, self.every_s = log, every_s
        self.down_since: float | None = None
        self.num_failures = 0
        self._last_line = 0.0

    @property
    def is_down(self) -> bool:
        return self.down_since is not None

    def failed(self, doing: str, exc: BaseException) -> None:
        """An operation failed because Redis is unreachable (`doing`: what it was, for the log)."""
        now = time.monotonic()
        self.num_failures += 1
        if self.down_since is None:
            self.down_since = self._last_line = now
            self.num_failures = 1
            self.log.warning("redis unavailable while %s: %s", doing, exc)
        elif now - self._last_line >= self.every_s:
            self._last_line = now
            self.log.warning(
                "redis still unavailable after %.0f s (%d failed operations; last while %s: %s)",
                now - self.down_since,
                self.num_failures,
                doing,
                exc,
            )

    def recovered(self) -> bool:
        """An operation succeeded: ends the outage, if there was one (then True)."""
        if self.down_since is None:
            return False
        self.log.info(
            "redis is back after %.1f s (%d failed operations)",
            time.monotonic() - self.down_since,
            self.num_failures,
        )
        self.down_since = None
        return True
