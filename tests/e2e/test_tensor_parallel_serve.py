"""`pagedserve engine --tensor-parallel-size 2 --device cpu` behind the real gateway: the same greedy
answer as the one-rank engine, and on SIGTERM it drains, stops its worker rank and exits cleanly."""

from __future__ import annotations

import os
import time

import httpx
import openai
import psutil

from tests.conftest import RunningServices, start_service, stop_all

TP_MODEL = "smollm2-tp2"


def test_tensor_parallel_engine_answers_through_the_gateway(services: RunningServices) -> None:
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": services.redis_url}
    common = ["--served-model-name", TP_MODEL, "--max-model-len", "2048"]
    engine_args = [
        "engine",
        *common,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--cpu-threads",
        "1",
        "--tensor-parallel-size",
        "2",
    ]
    processes = {
        "tp-tokenizer": start_service("tp-tokenizer", ["tokenizer", *common], env, services.log_dir),
        "tp-engine": start_service("tp-engine", engine_args, env, services.log_dir),
    }
    try:
        deadline = time.monotonic() + 180
        while TP_MODEL not in [m["id"] for m in httpx.get(f"{services.base_url}/v1/models").json()["data"]]:
            assert all(p.poll() is None for p in processes.values()), "the TP=2 services died"
            assert time.monotonic() < deadline, "the TP=2 engine did not register"
            time.sleep(0.25)
        children = psutil.Process(processes["tp-engine"].pid).children()
        workers = [c for c in children if "pagedserve.services.engine.executor.worker" in " ".join(c.cmdline())]
        assert len(workers) == 1  # rank 1 (beside it: the engine's publisher process)

        client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        answers = [
            client.chat.completions.create(model=m, messages=messages, temperature=0, max_tokens=12)
            for m in (services.model, TP_MODEL)
        ]
        one_rank, two_ranks = (a.choices[0].message.content for a in answers)
        assert two_ranks and "Paris" in two_ranks
        assert two_ranks == one_rank
    finally:
        stop_all(processes)
    assert processes["tp-engine"].returncode == 0  # drained, stopped its worker, exited
    assert all(not c.is_running() or c.status() == psutil.STATUS_ZOMBIE for c in children)  # the publisher too
