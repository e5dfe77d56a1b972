"""The ops port of a worker service (engine, tokenizer): /metrics (Prometheus), /health, /ready.

A plain threaded HTTP server on a daemon thread, apart from the service's event loop and compute
loop, so probes and scrapes answer even while a step runs. /health: the process is up. /ready: the
`is_ready` callback (Redis reached, serving, not draining) holds; 503 otherwise.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def serve_ops(
    port: int, registry: CollectorRegistry, is_ready: Callable[[], bool], host: str = "127.0.0.1"
) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/health":
                self._reply(200, b'{"status":"ok"}', "application/json")
            elif path == "/ready":
                ready = bool(is_ready())
                self._reply(200 if ready else 503, json.dumps({"ready": ready}).encode(), "application/json")
            else:
                self._reply(404, b"not found", "text/plain")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # probes every few seconds would flood the log
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="ops-http", daemon=True).start()
    return server
