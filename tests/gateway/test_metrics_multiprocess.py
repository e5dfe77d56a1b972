"""With PROMETHEUS_MULTIPROC_DIR set, each gateway worker process writes its metrics to shared files
and /metrics on any worker shows the sum over all of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import multiprocess
from prometheus_client.parser import text_string_to_metric_families

_WORKER = """
from pagedserve.services.gateway.metrics import GatewayMetrics
m = GatewayMetrics()
assert m.multiprocess
m.requests.labels("/v1/chat/completions", "200").inc({n})
m.ttft.labels("m").observe(0.2)
in_flight = {n}
m.track_in_flight(lambda: in_flight)
m.refresh()
import os, sys
sys.stdout.write(m.exposition().decode() if {scrape} else str(os.getpid()))
"""


def _run(code: str, env: dict[str, str]) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2]
    ).stdout


def test_workers_share_one_view_of_the_metrics(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    first_pid = int(_run(_WORKER.format(n=2, scrape=False), env))  # an earlier worker, exited
    multiprocess.mark_process_dead(first_pid, str(tmp_path))  # what the worker manager does when one exits
    text = _run(_WORKER.format(n=3, scrape=True), env)  # the worker that answers the scrape
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("pagedserve_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))] == 5
    assert samples[("pagedserve_time_to_first_token_seconds_count", (("model", "m"),))] == 2
    # livesum: only live workers count (the first one exited), so in-flight is this worker's 3.
    assert samples[("pagedserve_requests_in_flight", ())] == 3
