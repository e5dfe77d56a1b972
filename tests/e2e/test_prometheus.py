"""A real Prometheus server (Debian's package) scrapes the gateway, tokenizer and engine; PromQL over
its HTTP API sees the requests, the TTFT histogram and the KV usage, and every expression of the
Grafana dashboard is valid PromQL over metric names the services really export."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pagedserve.shared.redis_server import free_port
from tests.conftest import RunningServices

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/pagedserve.json"


@pytest.fixture(scope="module")
def prometheus(services: RunningServices, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Debian's prometheus package is not installed (.ci/run installs it)")
    assert services.metrics_ports is not None
    work = tmp_path_factory.mktemp("prometheus")
    gateway = services.base_url.removeprefix("http://")
    jobs = {
        "gateway": gateway,
        "tokenizer": f"127.0.0.1:{services.metrics_ports['tokenizer']}",
        "engine": f"127.0.0.1:{services.metrics_ports['engine']}",
    }
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": f"pagedserve-{job}", "static_configs": [{"targets": [target]}]} for job, target in jobs.items()
        ],
    }
    (work / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log = (work / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work}/data",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (work / "prometheus.log").read_text()[-2000:]
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready"
            time.sleep(0.25)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _query(url: str, promql: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=10).json()
    assert reply["status"] == "success", (promql, reply)
    return list(reply["data"]["result"])


def _wait_for(url: str, promql: str, ok: Any, timeout_s: float = 30) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        result = _query(url, promql)
        if result and ok(result):
            return result
        assert time.monotonic() < deadline, f"{promql} -> {result}"
        time.sleep(0.5)


def test_prometheus_scrapes_every_service(services: RunningServices, prometheus: str) -> None:
    targets = _wait_for(prometheus, "up", lambda r: len(r) == 3 and all(s["value"][1] == "1" for s in r))
    assert {t["metric"]["job"] for t in targets} == {"pagedserve-gateway", "pagedserve-tokenizer", "pagedserve-engine"}
    before = _query(prometheus, 'sum(pagedserve_requests_total{route="/v1/chat/completions",status="200"})')
    start = float(before[0]["value"][1]) if before else 0.0

    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0)
    for i in range(3):
        client.chat.completions.create(
            model=services.model,
            messages=[{"role": "user", "content": f"Count to {i}"}],
            max_tokens=4,
            extra_body={"ignore_eos": True},
        )

    _wait_for(
        prometheus,
        'sum(pagedserve_requests_total{route="/v1/chat/completions",status="200"})',
        lambda r: float(r[0]["value"][1]) >= start + 3,
    )
    buckets = _wait_for(
        prometheus,
        f'pagedserve_time_to_first_token_seconds_bucket{{model="{services.model}"}}',
        lambda r: any(s["metric"]["le"] == "+Inf" and float(s["value"][1]) >= 3 for s in r),
    )
    assert len({s["metric"]["le"] for s in buckets}) >= 10  # a real histogram: one series per bucket
    kv = _wait_for(prometheus, "pagedserve_engine_kv_cache_usage_ratio", lambda r: len(r) == 1)
    assert 0.0 <= float(kv[0]["value"][1]) <= 1.0 and kv[0]["metric"]["job"] == "pagedserve-engine"
    _wait_for(prometheus, "sum(pagedserve_engine_generation_tokens_total)", lambda r: float(r[0]["value"][1]) >= 12)
    _wait_for(prometheus, "sum(pagedserve_tokenizer_requests_total)", lambda r: float(r[0]["value"][1]) >= 3)

    # The dashboard: valid PromQL over exported names only.
    panels = json.loads(DASHBOARD.read_text())["panels"]
    expressions = [t["expr"].replace("$__rate_interval", "1m") for p in panels for t in p["targets"]]
    exported = {s["metric"]["__name__"] for s in _query(prometheus, '{__name__=~"pagedserve_.*|vllm:.*"}')}
    used = {name for e in expressions for name in re.findall(r"\b(?:pagedserve_|vllm:)[\w:]+", e)}
    assert any(name.startswith("vllm:") for name in used)  # the dashboard speaks vLLM's names
    assert used <= exported, f"dashboard metrics not exported: {sorted(used - exported)}"
    for expr in expressions:
        _query(prometheus, expr)
