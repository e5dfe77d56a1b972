"""`pagedserve status`'s table and `serve`'s readiness poll, without a server."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from pagedserve.services.readiness import local_url, missing_models
from pagedserve.services.status import Status, StreamLag, render
from pagedserve.shared.protocol import EngineHeartbeat


def test_status_shows_each_engine_and_stream() -> None:
    beat = EngineHeartbeat(
        engine_id="e1",
        model="m",
        max_model_len=8,
        num_running=3,
        num_waiting=1,
        num_free_blocks=25,
        num_total_blocks=100,
        time=100.0,
    )
    lag = StreamLag("m", "ps:m:gen", "engines:m", backlog=7, oldest_waiting_s=2.5, pending=2, oldest_pending_s=None)
    text = render(Status([beat], [lag]), now=104.0)
    assert text.startswith("models live: m")
    engine_row = next(line for line in text.splitlines() if line.startswith("m ") and "e1" in line)
    assert engine_row.split() == ["m", "e1", "live", "3", "1", "75%", "4.0s"]
    stream_row = next(line for line in text.splitlines() if "ps:m:gen" in line)
    assert stream_row.split() == ["m", "ps:m:gen", "engines:m", "7", "2.5s", "2", "-"]
    assert render(Status([], []), now=0).startswith("models live: none")


@pytest.fixture()
def ready_server() -> Iterator[tuple[str, dict[str, object]]]:
    answer: dict[str, object] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(answer["body"]).encode()
            self.send_response(int(str(answer["status"])))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield local_url("0.0.0.0", server.server_address[1]), answer
    server.shutdown()


def test_readiness_names_the_models_without_an_engine(ready_server: tuple[str, dict[str, object]]) -> None:
    url, answer = ready_server
    assert url.startswith("http://127.0.0.1:")
    answer.update(status=200, body={"ready": True, "models": ["a", "b"]})
    assert missing_models(url, ["a", "b"]) == []
    answer.update(status=503, body={"ready": False, "models": ["a"]})
    assert missing_models(url, ["a", "b"]) == ["b"]
    answer.update(status=503, body={"ready": False, "models": []})
    assert missing_models(url, []) is None  # not ready, and nothing named is missing: Redis down or draining
    assert missing_models("http://127.0.0.1:1", ["a"], timeout_s=0.2) is None  # nothing listening
