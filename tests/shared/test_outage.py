"""OutageLog: one warning per outage, reminders at most every `every_s`, one line when it ends."""

from __future__ import annotations

import logging

import pytest

from pagedserve.shared.outage import OutageLog


def test_an_outage_logs_once_then_reminds_then_recovers(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr("pagedserve.shared.outage.time.monotonic", lambda: now[0])
    outage = OutageLog(logging.getLogger("test.outage"), every_s=10.0)
    outage.recovered()  # nothing to end
    with caplog.at_level(logging.INFO, logger="test.outage"):
        for _ in range(1000):  # a hot loop of failures within 5 s
            outage.failed("publishing", ConnectionError("refused"))
            now[0] += 0.005
        assert [r.levelname for r in caplog.records] == ["WARNING"] and outage.is_down
        now[0] += 6.0  # past every_s since the first line
        outage.failed("publishing", ConnectionError("refused"))
        assert "still unavailable after 11 s (1001 failed" in caplog.records[-1].getMessage()
        outage.recovered()
        outage.recovered()
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING", "INFO"]
    assert "back after 11.0 s" in caplog.records[-1].getMessage() and not outage.is_down
