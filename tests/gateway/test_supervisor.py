"""The gateway supervisor's restart budget, and the limits on the new gateway settings."""

from __future__ import annotations

import pytest

from pagedserve.services.gateway.main import RestartBudget
from pagedserve.shared.config import Config


def test_restarts_are_bounded_per_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("pagedserve.services.gateway.main.time.monotonic", lambda: now[0])
    budget = RestartBudget(per_minute=3)
    assert [budget.allow() for _ in range(4)] == [True, True, True, False]  # a crash loop gives up
    now[0] += 61  # a minute later the budget is back
    assert budget.allow() and budget.recent == 1


def test_keepalive_must_stay_below_what_proxies_allow() -> None:
    assert Config.of(sse_keepalive_s=15).gateway.sse_keepalive_s == 15
    for bad in (0, 16):
        with pytest.raises(ValueError, match="sse_keepalive_s"):
            Config.of(sse_keepalive_s=bad)
    with pytest.raises(ValueError, match="max_queue_wait_s"):
        Config.of(max_queue_wait_s=0)
