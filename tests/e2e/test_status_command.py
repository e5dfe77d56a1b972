"""`pagedserve status` shows the live models, each engine's load, and the streams' backlog and pending work."""

from __future__ import annotations

import subprocess
import sys
import time

import redis

from pagedserve.shared import streams
from tests.conftest import RunningServices


def _status(services: RunningServices) -> str:
    command = [sys.executable, "-m", "pagedserve", "status", "--redis-url", services.redis_url]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    return result.stdout


def _row(text: str, *cells: str) -> list[str]:
    rows = [line.split() for line in text.splitlines() if all(c in line.split() for c in cells)]
    assert len(rows) == 1, f"no single row with {cells} in:\n{text}"
    return rows[0]


def test_status_lists_engines_and_stream_lag(services: RunningServices) -> None:
    ghost = f"ghost-model-{time.time_ns()}"  # queued work for a model no engine serves
    r = redis.Redis.from_url(services.redis_url)
    try:
        r.xgroup_create(streams.request_stream(ghost), streams.TOKENIZER_GROUP, id="0", mkstream=True)
        for _ in range(3):
            r.xadd(streams.request_stream(ghost), {streams.DATA_FIELD: b"queued"})
        r.xreadgroup(streams.TOKENIZER_GROUP, "someone", {streams.request_stream(ghost): ">"}, count=1)
        engine_ids = [k.decode().rsplit(":", 1)[1] for k in r.scan_iter(match=streams.engine_key(services.model, "*"))]
        text = _status(services)
    finally:
        r.delete(streams.request_stream(ghost))
        r.close()

    assert f"models live: {services.model}" in text.splitlines()[0]
    assert len(engine_ids) == 1
    engine = _row(text, engine_ids[0])
    assert engine[:3] == [services.model, engine_ids[0], "live"]
    assert engine[3].isdigit() and engine[4].isdigit() and engine[5].endswith("%")
    served = _row(text, streams.generate_stream(services.model))
    assert served[2] == streams.engine_group(services.model) and served[3].isdigit()
    queued = _row(text, streams.request_stream(ghost))
    # model, stream, group, backlog 2, oldest waiting age, pending 1, oldest pending age
    assert queued[0] == ghost and queued[2] == streams.TOKENIZER_GROUP
    assert queued[3] == "2" and queued[4].endswith("s") and queued[5] == "1" and queued[6].endswith("s")
