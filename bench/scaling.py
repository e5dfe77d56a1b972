"""Horizontal scaling on one host: the same load through one gateway over 1, 2, ... engine replicas, one per GPU.

For each engine count N: a private Redis, one tokenizer, a gateway with --workers, and N engines on
cuda:0..N-1 serve a model directory (bench/serve/random_model.py writes random-weight ones); then
bench.serve sends the workload (default 512 concurrent requests x 512 prompt x 256 output tokens) while
a monitor reads every engine's heartbeat, to show how pull-based admission spreads the running
sequences (target: every replica's mean running count within 10% of the replicas' mean).

    python -m bench.scaling --model-dir build/random-models/llama-3.1-8b-random --engines 1,2 --out $OUT

Prints a table and writes scaling_<gpu>.json and .md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from bench.servers import wait_ready
from pagedserve.shared import streams
from pagedserve.shared.protocol import EngineHeartbeat, decode_as
from pagedserve.shared.redis_server import PrivateRedis, free_port


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--engines", default="1,2", help="engine counts to run, e.g. 1,2,4 (one GPU each)")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=512)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--workers", type=int, default=4, help="gateway workers")
    p.add_argument("--client-processes", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--device", default="cuda", help="cuda: engine i on cuda:i; cpu: a smoke test of the script")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    return p.parse_args()


class HeartbeatMonitor(threading.Thread):
    """Samples every engine's running count from its heartbeat record while the load runs."""

    def __init__(self, redis_url: str, model: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(redis_url)
        self.pattern = streams.engine_key(model, "*")
        self.samples: list[dict[str, EngineHeartbeat]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.25):
            keys = list(self.client.scan_iter(match=self.pattern))
            values: Any = self.client.mget(keys) if keys else []  # redis-py types it as a sync-or-async union
            beats = [decode_as(raw, EngineHeartbeat) for raw in values if raw]
            self.samples.append({b.engine_id: b for b in beats})

    def balance(self) -> dict[str, Any]:
        """Each engine's mean running count over the busy samples, and the largest deviation from their mean."""
        peak = max((sum(b.num_running for b in s.values()) for s in self.samples), default=0)
        busy = [s for s in self.samples if peak and sum(b.num_running for b in s.values()) >= peak / 2]
        engine_ids = sorted({e for s in busy for e in s})
        means = {e: statistics.fmean(s[e].num_running if e in s else 0 for s in busy) for e in engine_ids}
        overall = statistics.fmean(means.values()) if means else 0.0
        deviation = max((abs(m - overall) / overall for m in means.values()), default=0.0) if overall else 0.0
        finished = {e: max(s[e].num_requests_finished for s in self.samples if e in s) for e in engine_ids}
        return {
            "running_mean": {e: round(m, 1) for e, m in means.items()},
            "max_deviation": round(deviation, 4),
            "requests_finished": finished,
            "busy_samples": len(busy),
        }


def run_level(args: argparse.Namespace, num_engines: int, model: str) -> dict[str, Any]:
    redis_server = PrivateRedis().start()
    port = free_port()
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": redis_server.url}
    me = [sys.executable, "-m", "pagedserve.services.cli"]
    common = ["--model", args.model_dir, "--max-model-len", str(args.max_model_len)]
    commands = [
        [*me, "tokenizer", *common],
        [
            *me,
            "gateway",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            str(args.workers),
            "--max-in-flight",
            str(2 * args.concurrency),
        ],
    ]
    devices = [f"cuda:{i}" if args.device == "cuda" else args.device for i in range(num_engines)]
    commands += [
        [*me, "engine", *common, "--device", device, "--engine-id", f"engine-{i}"] for i, device in enumerate(devices)
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    logs = [(args.out / f"scaling_{num_engines}e_{i}.log").open("wb") for i in range(len(commands))]
    processes = [subprocess.Popen(c, env=env, stdout=log, stderr=subprocess.STDOUT) for c, log in zip(commands, logs)]
    monitor = HeartbeatMonitor(redis_server.url, model)
    try:
        wait_ready(f"http://127.0.0.1:{port}", processes, timeout_s=600)
        while len(list(monitor.client.scan_iter(match=monitor.pattern))) < num_engines:
            time.sleep(0.5)
        monitor.start()
        name = f"scaling_{num_engines}e"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.serve",
                "--url",
                f"http://127.0.0.1:{port}",
                "--model",
                model,
                "--tokenizer",
                args.model_dir,
                "--num-prompts",
                str(args.num_prompts),
                "--max-concurrency",
                str(args.concurrency),
                "--input-len",
                str(args.input_len),
                "--output-len",
                str(args.output_len),
                "--client-processes",
                str(args.client_processes),
                "--result-dir",
                str(args.out),
                "--result-name",
                name,
            ],
            check=True,
        )
        monitor.stopped.set()
        served = json.loads((args.out / f"{name}.json").read_text())
        main_run = served["runs"]["main"]
        return {
            "engines": num_engines,
            "output_throughput": main_run["output_throughput"],
            "failed": main_run["failed"],
            **monitor.balance(),
        }
    finally:
        monitor.stopped.set()
        for p in reversed(processes):
            if p.poll() is None:
                p.terminate()
        for p in processes:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        redis_server.stop()


def main() -> None:
    args = parse_args()
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    model = Path(args.model_dir).name
    rows = [run_level(args, int(n), model) for n in args.engines.split(",")]
    base = rows[0]["output_throughput"] / rows[0]["engines"]
    lines = [
        f"# Horizontal scaling: {model}, {args.num_prompts} requests x {args.input_len} x {args.output_len}, "
        f"concurrency {args.concurrency}, {gpu}, {datetime.now(UTC):%Y-%m-%d}",
        "",
        "| engines | out tok/s | vs one engine | running per engine (mean) | max deviation | finished | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        row["speedup"] = round(row["output_throughput"] / base, 3)
        lines.append(
            f"| {row['engines']} | {row['output_throughput']:.0f} | {row['speedup']:.2f}x | "
            f"{row['running_mean']} | {row['max_deviation']:.1%} | {row['requests_finished']} | "
            f"{row['failed']} |"
        )
    report = "\n".join(lines)
    print(report)
    tag = "h200" if "H200" in gpu else "h100" if "H100" in gpu else "gpu"
    (args.out / f"scaling_{tag}.md").write_text(
        report + "\n\nCommand: python -m bench.scaling " + " ".join(sys.argv[1:]) + "\n"
    )
    (args.out / f"scaling_{tag}.json").write_text(
        json.dumps({"device": gpu, "rows": rows, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1)
    )


if __name__ == "__main__":
    main()
