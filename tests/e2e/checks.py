"""Checks every failure test ends with: nothing pending in Redis, and a normal request answered."""

from __future__ import annotations

import time

import openai
import redis

from pagedserve.shared import streams


def num_pending(r: redis.Redis, model: str) -> dict[str, int]:
    """Entries delivered but not acknowledged, per stream (the tokenizers' requests, the engines' shared
    stream, and each engine's own stream, where the prefix router sends work)."""
    engine_streams = [k.decode() for k in r.scan_iter(match=streams.engine_stream_pattern(model))]
    counts = {}
    for stream, group in (
        (streams.request_stream(model), streams.TOKENIZER_GROUP),
        (streams.generate_stream(model), streams.engine_group(model)),
        *((stream, streams.engine_group(model)) for stream in engine_streams),
    ):
        try:
            counts[stream] = int(r.xpending(stream, group)["pending"])
        except redis.ResponseError:  # no such stream or group: nothing can be pending
            counts[stream] = 0
    return counts


def wait_nothing_pending(redis_url: str, model: str, timeout_s: float = 40) -> None:
    r = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while any((pending := num_pending(r, model)).values()):
            assert time.monotonic() < deadline, f"still pending in Redis: {pending}"
            time.sleep(0.25)
    finally:
        r.close()


def answer_normally(base_url: str, model: str) -> None:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120) as client:
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=8,
        )
    assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage is not None
    assert reply.usage.completion_tokens >= 1
