"""When each request of a burst passed each Redis hop, read back from the streams' entry ids (issue 23).

A stream entry's id is the Redis server's clock in ms when it was added, so the streams a run leaves behind
time every request at no cost to the run:

    gateway    the gateway's XADD to ps:{model}:req (the HTTP request parsed and validated)
    tokenizer  the tokenizer's XADD of the work to ps:{model}:gen or an engine's own stream

Requests are grouped into bursts (a gap over --gap-ms starts a new one); each burst of at least --min-burst
requests gets a line: how long its requests took to reach each hop (the spread from its first request), and
the tokenizer's own latency per request. Served TTFT at high concurrency is mostly this ramp plus prefill.

    python -m bench.stream_timeline --redis-url redis://127.0.0.1:6379/0 --model NAME [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import redis

from pagedserve.shared import streams
from pagedserve.shared.protocol import DecodeError, decode


def entry_ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-")[0])


def stream_times(client: redis.Redis, stream: str) -> dict[str, int]:
    """request id -> when its message was added to `stream` (ms); the first time, for a redelivered one."""
    times: dict[str, int] = {}
    entries: Any = client.xrange(stream)
    for entry_id, fields in entries:
        try:
            message = decode(fields.get(streams.DATA_FIELD, b""))
        except DecodeError:
            continue
        request_id = getattr(message, "request_id", None)
        if isinstance(request_id, str):
            times.setdefault(request_id, entry_ms(entry_id))
    return times


def bursts(arrivals: dict[str, int], gap_ms: int) -> list[list[str]]:
    ordered = sorted(arrivals, key=arrivals.__getitem__)
    groups: list[list[str]] = []
    for rid in ordered:
        if groups and arrivals[rid] - arrivals[groups[-1][-1]] <= gap_ms:
            groups[-1].append(rid)
        else:
            groups.append([rid])
    return groups


def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def describe(group: list[str], gateway: dict[str, int], tokenizer: dict[str, int]) -> dict[str, Any]:
    t0 = gateway[group[0]]
    at_gateway = [gateway[r] - t0 for r in group]
    done = [r for r in group if r in tokenizer]
    at_tokenizer = [tokenizer[r] - t0 for r in done]
    latency = [tokenizer[r] - gateway[r] for r in done]
    return {
        "requests": len(group),
        "forwarded": len(done),
        "gateway_spread_ms": {q: percentile(at_gateway, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("max", 1.0))},
        "tokenizer_spread_ms": (
            {q: percentile(at_tokenizer, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("max", 1.0))} if done else {}
        ),
        "tokenizer_latency_ms": (
            {"p50": percentile(latency, 0.5), "p90": percentile(latency, 0.9), "mean": statistics.fmean(latency)}
            if done
            else {}
        ),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--model", required=True, help="the served model name (the streams' key)")
    parser.add_argument("--gap-ms", type=int, default=200)
    parser.add_argument("--min-burst", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    client = redis.Redis.from_url(args.redis_url)
    gateway = stream_times(client, streams.request_stream(args.model))
    forwarded: dict[str, int] = {}
    targets = [streams.generate_stream(args.model)]
    targets += [k.decode() for k in client.scan_iter(match=streams.engine_stream_pattern(args.model))]
    for stream in targets:
        for rid, ms in stream_times(client, stream).items():
            forwarded[rid] = min(ms, forwarded.get(rid, ms))
    rows = [describe(g, gateway, forwarded) for g in bursts(gateway, args.gap_ms) if len(g) >= args.min_burst]
    print("| burst | requests | at gateway p50/p90/max ms | at engine stream p50/p90/max ms | tokenizer ms p50/p90 |")
    print("| ---: | ---: | --- | --- | --- |")
    for i, row in enumerate(rows):
        g, t, lat = row["gateway_spread_ms"], row["tokenizer_spread_ms"], row["tokenizer_latency_ms"]
        print(
            f"| {i} | {row['requests']} | {g['p50']}/{g['p90']}/{g['max']} | "
            f"{t.get('p50')}/{t.get('p90')}/{t.get('max')} | {lat.get('p50')}/{lat.get('p90')} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
