"""Multi-turn chat and agent load: conversations sharing a few long system prompts, history growing each
turn; reports the prefix hit rate the servers saw, TTFT, ITL and throughput (the workload that shows
whether routing keeps each conversation's cache).

Each of `--users` users holds one conversation of `--turns` turns, at most `--max-concurrency` at once:

    turn t prompt = system prompt (one of --system-prompts, --system-len tokens)
                    [+ shared tool list, --tools-len tokens: the agent-like mix]
                    [+ this user's own context, --context-len tokens: a document, a repository's files]
                    + (user message, reply) of every earlier turn + this turn's user message

Replies are the server's own tokens (`return_token_ids`), so each turn's prompt extends the previous
turn's exactly, as a chat client's does. `--think-time` waits between a reply and the next turn.
The hit rate is usage.prompt_tokens_details.cached_tokens over prompt tokens, per response; with
`--metrics-url` (an engine's /metrics, repeatable) also vllm:prefix_cache_hits / queries over the run.

    python -m bench serve_multiturn --url http://127.0.0.1:8000 --model M --tokenizer DIR
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.serve.client import ClientConfig, RequestResult, new_session, send
from bench.serve.datasets import BenchRequest, TokenSource
from bench.serve.metrics import distribution_ms


@dataclass(slots=True)
class Workload:
    system_prompts: int = 8
    system_len: int = 2048
    tools_len: int = 0  # > 0: every prompt also carries one shared tool list (an agent's)
    context_len: int = 0  # > 0: each user's own context after the system prompt (RAG, a coding agent's files)
    users: int = 64
    turns: int = 8
    user_len: int = 64
    output_len: int = 64
    think_time_s: float = 0.0
    ramp_up_s: float = 0.0
    seed: int = 0


@dataclass(slots=True)
class Conversation:
    history: list[int]  # system prompt [+ tools]; grows by each turn's message and reply
    messages: list[list[int]]  # this user's message of each turn
    results: list[RequestResult] = field(default_factory=list)


def conversations(pool: list[int], workload: Workload) -> list[Conversation]:
    """The users' conversations: random ids from the tokenizer's ordinary-token pool."""
    rng = random.Random(workload.seed)
    draw = lambda n: [rng.choice(pool) for _ in range(n)]
    systems = [draw(workload.system_len) for _ in range(workload.system_prompts)]
    tools = draw(workload.tools_len)
    return [
        Conversation(
            [*systems[user % workload.system_prompts], *tools, *draw(workload.context_len)],
            [draw(workload.user_len) for _ in range(workload.turns)],
        )
        for user in range(workload.users)
    ]


async def run(config: ClientConfig, convs: list[Conversation], workload: Workload, max_concurrency: int) -> float:
    """Every conversation to its end, at most `max_concurrency` at once; returns the wall time."""
    gate = asyncio.Semaphore(max_concurrency)
    rng = random.Random(workload.seed + 1)

    async def converse(session: Any, conv: Conversation, delay: float) -> None:
        await asyncio.sleep(delay)
        async with gate:
            for turn, message in enumerate(conv.messages):
                prompt = [*conv.history, *message]
                result = await send(session, config, BenchRequest(prompt, workload.output_len))
                conv.results.append(result)
                if not result.ok:
                    return  # a conversation cannot go on without its reply
                reply = result.output_ids or [rng.choice(message) for _ in range(result.output_tokens)]
                conv.history = [*prompt, *reply]
                if workload.think_time_s and turn + 1 < len(conv.messages):
                    await asyncio.sleep(rng.expovariate(1 / workload.think_time_s))

    async with new_session(config, max_concurrency) as session:
        started = time.perf_counter()
        delays = [rng.uniform(0, workload.ramp_up_s) for _ in convs]
        await asyncio.gather(*(converse(session, conv, delay) for conv, delay in zip(convs, delays, strict=True)))
        return time.perf_counter() - started


def scrape_prefix_cache(urls: list[str]) -> dict[str, float]:
    """vllm:prefix_cache_{hits,queries} summed over the engines' /metrics."""
    totals = {"hits": 0.0, "queries": 0.0}
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
            for name in totals:
                if family.name == f"vllm:prefix_cache_{name}":
                    totals[name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals


def finished_per_engine(base_url: str) -> dict[str, float]:
    """Requests each engine replica has finished, from the gateway's /metrics (the engines' heartbeats)."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=10).text):
        if family.name == "pagedserve_engine_requests_finished":
            for sample in family.samples:
                counts[sample.labels["engine_id"]] = sample.value
    return counts


def summarize(convs: list[Conversation], seconds: float) -> dict[str, Any]:
    results = [r for conv in convs for r in conv.results]
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_len for r in ok)
    later_turns = [r for conv in convs for r in conv.results[1:] if r.ok]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "seconds": round(seconds, 3),
        "request_throughput": round(len(ok) / seconds, 3) if seconds else 0.0,
        "output_throughput": round(sum(r.output_tokens for r in ok) / seconds, 1) if seconds else 0.0,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "prefix_hit_rate": round(sum(r.cached_tokens for r in ok) / prompt_tokens, 4) if prompt_tokens else 0.0,
        "ttft_ms": distribution_ms([r.ttft for r in ok]),
        "ttft_ms_later_turns": distribution_ms([r.ttft for r in later_turns]),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def samples(convs: list[Conversation]) -> dict[str, list[float]]:
    """Every request's TTFT and every gap between tokens, in ms (for CDF plots across runs)."""
    ok = [r for conv in convs for r in conv.results if r.ok]
    return {
        "ttft_ms": [round(r.ttft * 1e3, 3) for r in ok],
        "itl_ms": [round(gap * 1e3, 3) for r in ok for gap in r.itl],
        "turn": [turn for conv in convs for turn, r in enumerate(conv.results) if r.ok],
    }


def markdown(report: dict[str, Any]) -> str:
    s, w = report["summary"], report["workload"]
    rate = f"{s['prefix_hit_rate']:.1%}"
    if "server_prefix_hit_rate" in s:
        rate += f" (engines' /metrics: {s['server_prefix_hit_rate']:.1%})"

    def dist(d: dict[str, float]) -> str:
        return f"{d['p50']:.1f} / {d['p99']:.1f}"

    return "\n".join(
        [
            f"# Multi-turn load: {report['model']} at {report['url']}",
            "",
            f"{report['date']}; {report.get('label') or ''}",
            "",
            f"`{report['command']}`",
            "",
            f"{w['users']} users x {w['turns']} turns, {w['system_prompts']} system prompts x {w['system_len']} "
            f"tokens, tools {w['tools_len']}, own context {w.get('context_len', 0)}, user turns {w['user_len']}, "
            f"replies {w['output_len']} tokens, think time {w['think_time_s']} s, ramp-up "
            f"{w.get('ramp_up_s', 0.0)} s, concurrency {report['max_concurrency']}",
            "",
            "| ok / failed | prefix hit rate | TTFT ms p50/p99 | later turns TTFT p50/p99 | ITL ms p50/p99 "
            "| req/s | out tok/s |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            f"| {s['completed']} / {s['failed']} | {rate} | {dist(s['ttft_ms'])} | {dist(s['ttft_ms_later_turns'])} "
            f"| {dist(s['itl_ms'])} | {s['request_throughput']:.2f} | {s['output_throughput']:,.0f} |",
            "",
            f"Requests per engine replica: {s.get('requests_per_engine')}",
            "",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer", default=None, help="a local tokenizer (default: the server's /tokenize)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--tools-len", type=int, default=0, help="a shared tool list on every prompt (agent mix)")
    p.add_argument("--context-len", type=int, default=0, help="each user's own context tokens (RAG, agent files)")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--think-time", type=float, default=0.0, help="mean seconds between a reply and the next turn")
    p.add_argument("--ramp-up", type=float, default=0.0, help="conversations start uniformly over this many seconds")
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-url", action="append", default=[], help="an engine's /metrics (repeatable)")
    p.add_argument("--label", default="", help="what ran, for the report (device, routing)")
    p.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--result-name", default="serve_multiturn")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    workload = Workload(
        args.system_prompts,
        args.system_len,
        args.tools_len,
        args.context_len,
        args.users,
        args.turns,
        args.user_len,
        args.output_len,
        args.think_time,
        args.ramp_up,
        args.seed,
    )
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    source = TokenSource.local(args.tokenizer) if args.tokenizer else TokenSource.server(args.url, args.model, headers)
    convs = conversations(source.pool, workload)
    config = ClientConfig(args.url, args.model, api_key=args.api_key, extra_body={"return_token_ids": True})
    before = scrape_prefix_cache(args.metrics_url) if args.metrics_url else None
    finished_before = finished_per_engine(args.url)
    seconds = asyncio.run(run(config, convs, workload, args.max_concurrency))
    summary = summarize(convs, seconds)
    time.sleep(2)  # the engines' next heartbeats carry their counts
    finished = finished_per_engine(args.url)
    summary["requests_per_engine"] = {e: int(n - finished_before.get(e, 0)) for e, n in sorted(finished.items())}
    if before is not None:
        after = scrape_prefix_cache(args.metrics_url)
        queries = after["queries"] - before["queries"]
        summary["server_prefix_hit_rate"] = round((after["hits"] - before["hits"]) / queries, 4) if queries else 0.0
    report = {
        "url": args.url,
        "model": args.model,
        "label": args.label,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m bench serve_multiturn " + " ".join(sys.argv[1:] if argv is None else argv),
        "max_concurrency": args.max_concurrency,
        "workload": dataclasses.asdict(workload),
        "summary": summary,
        "samples": samples(convs),
    }
    args.result_dir.mkdir(parents=True, exist_ok=True)
    (args.result_dir / f"{args.result_name}.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (args.result_dir / f"{args.result_name}.md").write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
