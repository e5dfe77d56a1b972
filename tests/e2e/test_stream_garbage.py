"""Garbage on every stream is logged, acknowledged and skipped; the services keep serving."""

from __future__ import annotations

import time

import openai
import redis

from pagedserve.shared import streams
from tests.conftest import RunningServices


def test_garbage_entries_are_skipped_and_acked(services: RunningServices) -> None:
    r = redis.Redis.from_url(services.redis_url)
    model = services.model
    bad_entries = {
        streams.request_stream(model): r.xadd(streams.request_stream(model), {b"d": b"\xc1\xc1 garbage"}),
        streams.generate_stream(model): r.xadd(streams.generate_stream(model), {b"d": b"\x93\x01\x02\x03"}),
    }
    r.xadd(streams.control_stream(model), {b"d": b"not msgpack at all \xff"})
    gateway_streams = [k.decode() for k in r.scan_iter(match="ps:*:resp")]
    for stream in gateway_streams:
        r.xadd(stream, {b"d": b"\xff\xfe"})

    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=12,
    )
    assert "Paris" in (reply.choices[0].message.content or "")

    groups = {
        streams.request_stream(model): streams.TOKENIZER_GROUP,
        streams.generate_stream(model): streams.engine_group(model),
    }
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pending = {s: r.xpending_range(s, g, min="-", max="+", count=100) for s, g in groups.items()}
        if not any(e["message_id"] == bad_entries[s] for s, entries in pending.items() for e in entries):
            break
        time.sleep(0.2)
    for stream, entries in pending.items():
        assert bad_entries[stream] not in [e["message_id"] for e in entries], f"garbage left pending on {stream}"
    for name, process in services.processes.items():
        assert process.poll() is None, f"{name} died on garbage"
    r.close()
