"""Where a streamed request's first token spends its time, hop by hop, through the real services (issue 23).

Starts a private Redis and the three services (bench/servers.py), watches Redis with MONITOR (every command,
timestamped by the server), and sends single streamed completions one at a time. Each request's commands
are found by its id, which splits its time to first token into:

    gateway in    client sends -> the gateway's XADD to the tokenizer stream (HTTP, validation)
    tokenizer     -> the tokenizer's XADD of the work to an engine stream (read, tokenize, route)
    engine        -> the engine's XADD of the first tokens to the gateway (read, schedule, prefill, publish)
    gateway out   -> the client has the first chunk (read, detokenize, SSE)

With --engine-spans the engine prints its spans (--trace-console) and the engine hop is split further by
each request's engine.generate span (same host clock as Redis's):

    engine read   the work's XADD -> the engine has the request (I/O thread read, hand-over to compute)
    engine queue  -> the request is first scheduled (waiting for the compute thread's next step)
    engine step   -> the step that gave the first token has returned it
    engine send   -> the engine's XADD of those tokens (publish through the I/O thread)

    python -m bench.first_token_hops --model DIR [--engine-arg=--device --engine-arg=cpu] [--requests 40]
Prints a table of medians and writes JSON (--json). MONITOR itself slows Redis a little: compare runs of
this script with each other, not with a TTFT measured without it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import openai
import redis

from bench.servers import start_servers

HOPS = ("gateway in", "tokenizer", "engine", "gateway out")
ENGINE_PARTS = ("engine read", "engine queue", "engine step", "engine send")


def watch(url: str, commands: list[tuple[float, str]], stop: threading.Event) -> None:
    client = redis.Redis.from_url(url)
    with client.monitor() as monitor:
        for command in monitor.listen():
            commands.append((float(command["time"]), str(command["command"])))
            if stop.is_set():
                return


def first_at(commands: list[tuple[float, str]], after: float, *parts: str) -> float | None:
    return next((t for t, c in commands if t >= after and all(p in c for p in parts)), None)


def hops(commands: list[tuple[float, str]], start: float, first: float, request_id: str) -> dict[str, Any] | None:
    sent = first_at(commands, start, "XADD", ":req ", request_id)
    work = first_at(commands, start, "XADD", ":gen", "generate", request_id)
    tokens = first_at(commands, start, "XADD", ":resp ", "deltas", request_id)
    if sent is None or work is None or tokens is None:
        return None
    marks = (start, sent, work, tokens, first)
    row = {hop: (b - a) * 1e3 for hop, a, b in zip(HOPS, marks, marks[1:], strict=False)}
    return {**row, "_work": work, "_tokens": tokens}


def _epoch_s(iso: str) -> float:
    """ConsoleSpanExporter's ISO time (UTC, 'Z', up to nanoseconds) as seconds since the epoch."""
    whole, _, frac = iso.rstrip("Z").partition(".")
    start = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.UTC).timestamp()
    return start + float(f"0.{frac or 0}")


def engine_marks(log: str) -> dict[str, tuple[float, float | None, float | None]]:
    """request id -> (arrived, admitted, first token) in seconds, from the engine's console spans."""
    decoder, spans = json.JSONDecoder(), []
    for match in re.finditer(r"^\{$", log, flags=re.M):
        try:
            spans.append(decoder.raw_decode(log, match.start())[0])
        except json.JSONDecodeError:
            continue
    admitted = {s["parent_id"]: _epoch_s(s["start_time"]) for s in spans if s.get("name") == "engine.prefill"}
    marks: dict[str, tuple[float, float | None, float | None]] = {}
    for span in spans:
        if span.get("name") != "engine.generate":
            continue
        first = next((e for e in span.get("events", []) if e.get("name") == "gen_ai.first_token"), None)
        marks[str(span["attributes"].get("pagedserve.request_id"))] = (
            _epoch_s(span["start_time"]),
            admitted.get(span["context"]["span_id"]),
            _epoch_s(first["timestamp"]) if first else None,
        )
    return marks


def engine_parts(row: dict[str, Any], marks: tuple[float, float | None, float | None]) -> dict[str, float] | None:
    """The engine hop split at the span's marks (ms); None when a mark is missing."""
    arrived, admitted, first = marks
    if admitted is None or first is None:
        return None
    points = (row["_work"], arrived, admitted, first, row["_tokens"])
    return {part: (b - a) * 1e3 for part, a, b in zip(ENGINE_PARTS, points, points[1:], strict=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the model directory every service loads")
    parser.add_argument("--engine-arg", action="append", default=[], help="an engine argument (repeat)")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=6)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--engine-spans", action="store_true", help="split the engine hop by its console spans")
    parser.add_argument(
        "--text-prompt",
        action="store_true",
        help="send the prompt as text (its token ids decoded): the openai client transforms a token-id list "
        "element by element before sending (~6 ms for 512 ids), which 'gateway in' would count",
    )
    args = parser.parse_args()
    os.environ["PAGEDSERVE_MODEL"] = args.model
    servers = start_servers([*args.engine_arg, *(["--trace-console"] if args.engine_spans else [])])
    decode = None
    if args.text_prompt:
        from transformers import AutoTokenizer

        decode = AutoTokenizer.from_pretrained(args.model).decode
    commands: list[tuple[float, str]] = []
    stop = threading.Event()
    threading.Thread(target=watch, args=(servers.redis.url, commands, stop), daemon=True).start()
    rows: list[dict[str, Any]] = []
    try:
        client = openai.OpenAI(base_url=f"{servers.base_url}/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        for i in range(args.requests + 3):  # the first 3 warm every path up and are not counted
            time.sleep(0.2)  # one request at a time, each into an idle system
            ids = [1 + (i + j) % 1000 for j in range(args.prompt_len)]
            prompt: str | list[int] = str(decode(ids)) if decode is not None else ids
            start, first, request_id = time.time(), None, ""
            stream = client.completions.create(
                model=model, prompt=prompt, max_tokens=2, stream=True, extra_body={"ignore_eos": True}
            )
            for chunk in stream:
                request_id = chunk.id
                if first is None and chunk.choices and chunk.choices[0].text is not None:
                    first = time.time()
            time.sleep(0.05)  # MONITOR's lines for it arrive
            row = hops(commands, start, first or start, request_id) if i >= 3 else None
            if row is not None:
                rows.append({**row, "ttft": ((first or start) - start) * 1e3, "_id": request_id})
    finally:
        stop.set()
        servers.stop()
    keys: tuple[str, ...] = (*HOPS, "ttft")
    if args.engine_spans:
        time.sleep(0.5)
        marks = engine_marks((servers.log_dir / "engine.log").read_text(errors="replace"))
        for row in rows:
            found = next((m for request_id, m in marks.items() if row["_id"] in request_id), None)
            parts = engine_parts(row, found) if found is not None else None
            row.update(parts or {})
        rows = [row for row in rows if all(part in row for part in ENGINE_PARTS)]
        keys = (*HOPS, *ENGINE_PARTS, "ttft")
    result: dict[str, Any] = {"requests": len(rows), "engine_args": args.engine_arg, "prompt_len": args.prompt_len}
    result["prompt"] = "text" if args.text_prompt else "token ids"
    result["median_ms"] = {key: round(statistics.median(r[key] for r in rows), 3) for key in keys}
    print("| " + " | ".join(k if k != "ttft" else "TTFT" for k in keys) + " |")
    print("|" + "---|" * len(keys))
    print("| " + " | ".join(f"{result['median_ms'][key]:.2f}" for key in keys) + " |  (median ms)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
