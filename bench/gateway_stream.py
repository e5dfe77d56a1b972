"""The gateway's CPU time per streamed token, in one process: the chat SSE path from a delta in a request's
queue to the bytes of its chunk, for many concurrent streams (issue 23: at 256 concurrent on an H100 the four
gateway workers were busy for the whole run, bench/results/served_h100_wave3/pyspy/).

Each of `--streams` requests is a real Generation of a real Frontend (its Redis never reached), streamed by the
server's own generators (chat_events inside with_keepalives, metrics on as `serve` has them); a producer puts one
one-token delta per stream per step in the request queues, as the response router does when an engine's step
arrives, and the event loop runs the consumers. Not covered: reading the deltas from Redis (the router) and
uvicorn's socket writes. Reports CPU µs per token (process time, so other load on the machine counts less).

    python -m bench.gateway_stream [--streams 256] [--tokens 256] [--multiprocess] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedserve.services.gateway.detokenizer import ChoiceText
from pagedserve.services.gateway.frontend import Frontend, Generation
from pagedserve.services.gateway.router import Delta
from pagedserve.services.gateway.streaming import StreamFormat, chat_events, with_keepalives
from pagedserve.services.gateway.token_text import TokenTexts
from pagedserve.shared.config import Config
from pagedserve.shared.protocol import Accepted
from pagedserve.shared.redis_server import free_port

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the green forest. " * 20


async def _no_abort(*_: Any) -> None:
    return None


async def stream_all(frontend: Frontend, tokenizer: Any, streams: int, tokens: list[int]) -> tuple[float, int, int]:
    """CPU seconds, SSE bytes and SSE events for `streams` streams of len(tokens) one-token deltas (a consumer that
    falls behind merges what queued up into one event, as a real one does)."""
    prompt = tokenizer.encode("Hello there", add_special_tokens=False)
    gens = []
    for i in range(streams):
        request_id = f"r{i}"
        queue = frontend.router.register(request_id)
        frontend.num_in_flight += 1
        accepted = Accepted(request_id, len(prompt), len(tokens), list(prompt))
        gens.append(
            Generation(
                frontend, request_id, "m", accepted, queue, [ChoiceText(tokenizer, prompt, [])], TokenTexts(tokenizer)
            )
        )
    sent = [0, 0]

    async def consume(gen: Generation) -> None:
        async for event in with_keepalives(chat_events(gen, StreamFormat()), 15.0):
            sent[0] += len(event)
            sent[1] += 1

    start = time.process_time()
    consumers = [asyncio.create_task(consume(gen)) for gen in gens]
    for step, token in enumerate(tokens):
        finish = "length" if step == len(tokens) - 1 else None
        for gen in gens:
            gen.queue.put_nowait(Delta(0, [token], None, finish, 0, step + 1, 0, "e1", None))
        for _ in range(4):  # let every consumer take its delta before the next "step" arrives
            await asyncio.sleep(0)
    await asyncio.gather(*consumers)
    return time.process_time() - start, sent[0], sent[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256, help="one-token deltas per stream")
    parser.add_argument("--repeats", type=int, default=3, help="runs; the fastest is reported")
    parser.add_argument("--multiprocess", action="store_true", help="prometheus multiprocess mode (serve --workers N)")
    parser.add_argument("--tokenizer", type=Path, help="default: the packaged SmolLM2's")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.multiprocess:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="gateway-stream-prom-")
    from transformers import AutoTokenizer

    from pagedserve.services.gateway.metrics import GatewayMetrics
    from pagedserve.shared.model_source import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or resolve_model_dir(None))
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)[: args.tokens]
    assert len(tokens) == args.tokens, f"the text has {len(tokens)} tokens"

    async def run_once() -> tuple[float, int, int]:
        frontend = Frontend(Config.of(redis_url=f"redis://127.0.0.1:{free_port()}/0"))
        frontend.abort = _no_abort  # type: ignore[method-assign,assignment]
        frontend.metrics = GatewayMetrics()
        return await stream_all(frontend, tokenizer, args.streams, tokens)

    runs = [asyncio.run(run_once()) for _ in range(args.repeats)]
    total = args.streams * args.tokens
    per_token = [seconds / total * 1e6 for seconds, _, _ in runs]
    print(
        f"{args.streams} streams x {args.tokens} tokens, multiprocess metrics {args.multiprocess}: CPU µs per token "
        f"best {min(per_token):.1f}, median {statistics.median(per_token):.1f} "
        f"(runs {', '.join(f'{p:.1f}' for p in per_token)}); {runs[0][1] / total:.0f} SSE bytes and "
        f"{runs[0][2] / total:.3f} events per token"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"args": vars(args), "python": sys.version.split()[0], "cpu_us_per_token": per_token}
        report["events_per_token"] = [events / total for _, _, events in runs]
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
