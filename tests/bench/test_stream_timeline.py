"""bench.stream_timeline reads each request's hop times back from stream entry ids (a private Redis)."""

from __future__ import annotations

import redis

from bench import stream_timeline
from pagedserve.shared import streams
from pagedserve.shared.protocol import CompletionRequest, GenerateRequest, encode
from pagedserve.shared.redis_server import PrivateRedis


def _add(client: redis.Redis, stream: str, ms: int, seq: int, message: object) -> None:
    client.xadd(stream, {streams.DATA_FIELD: encode(message)}, id=f"{ms}-{seq}")


def test_bursts_and_hop_times_come_from_entry_ids(redis_server: PrivateRedis, capsys) -> None:
    client = redis.Redis.from_url(redis_server.url)
    model = "timeline-model"
    req, gen = streams.request_stream(model), streams.generate_stream(model)
    own = streams.engine_stream(model, "eng-1")
    for i in range(4):  # a burst of 4 at t=1000..1003 ms, forwarded 10*i ms later; even ones to a replica's own
        rid = f"b-{i}"
        _add(client, req, 1000 + i, 0, CompletionRequest(rid, "gw", model, [1, 2], {}, 8))
        target = own if i % 2 == 0 else gen
        _add(client, target, 1000 + 11 * i, i, GenerateRequest(rid, "gw", model, [1, 2], {}))
    _add(client, req, 5000, 0, CompletionRequest("lone", "gw", model, [1], {}, 8))  # its own burst: too small
    rows = stream_timeline.main(["--redis-url", redis_server.url, "--model", model, "--min-burst", "2"])
    assert len(rows) == 1 and rows[0]["requests"] == 4 and rows[0]["forwarded"] == 4
    assert rows[0]["gateway_spread_ms"] == {"p50": 2, "p90": 3, "max": 3}
    assert rows[0]["tokenizer_spread_ms"]["max"] == 33
    assert rows[0]["tokenizer_latency_ms"]["p50"] == 20 and rows[0]["tokenizer_latency_ms"]["mean"] == 15.0
    assert "| 0 | 4 |" in capsys.readouterr().out
