"""--engine-nice: the engine takes its niceness before it starts threads or children, which inherit it; without
the privilege a lower niceness needs, it logs and runs as it is."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from pagedserve.services.engine.main import set_niceness
from pagedserve.shared.config import Config

_CHILD = """
import os, threading
from pagedserve.services.engine.main import set_niceness
set_niceness(os.getpriority(os.PRIO_PROCESS, 0) + 3)
seen = []
thread = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
thread.start(); thread.join()
print(os.getpriority(os.PRIO_PROCESS, 0), seen[0])
"""


def test_a_thread_started_after_takes_the_engines_niceness() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True).stdout.split()
    assert [int(v) for v in out] == [min(base + 3, 19)] * 2


def test_without_the_privilege_it_warns_and_runs_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(which: int, who: int, value: int) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "setpriority", refuse)
    with caplog.at_level(logging.WARNING, logger="pagedserve.services.engine.main"):
        set_niceness(os.getpriority(os.PRIO_PROCESS, 0) - 5)
    assert "needs root or CAP_SYS_NICE" in caplog.text


@pytest.mark.parametrize("nice", [-21, 20])
def test_niceness_out_of_range_is_refused(nice: int) -> None:
    with pytest.raises(ValueError, match="engine_nice"):
        Config.of(engine_nice=nice)
