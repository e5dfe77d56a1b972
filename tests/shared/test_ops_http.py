"""The ops port of the worker services, and the healthcheck command that probes it."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry, Counter

from pagedserve.services.healthcheck import main as healthcheck
from pagedserve.shared.ops_http import serve_ops
from pagedserve.shared.redis_server import free_port


def test_metrics_health_and_readiness() -> None:
    registry = CollectorRegistry()
    Counter("pagedserve_test_things", "things", registry=registry).inc(3)
    ready = [False]
    port = free_port()
    server = serve_ops(port, registry, lambda: ready[0], host="127.0.0.1")
    base = f"http://127.0.0.1:{port}"
    try:
        assert "pagedserve_test_things_total 3.0" in httpx.get(f"{base}/metrics").text
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/ready").status_code == 503
        assert healthcheck([f"{base}/ready"]) == 1
        ready[0] = True
        assert httpx.get(f"{base}/ready").json() == {"ready": True}
        assert healthcheck([f"{base}/ready"]) == 0
    finally:
        server.shutdown()
        server.server_close()
    assert healthcheck([f"{base}/ready"]) == 1  # nothing listens any more
