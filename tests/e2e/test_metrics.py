"""The gateway's Prometheus endpoint counts what it served and shows each engine's load."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import RunningServices


def _samples(services: RunningServices) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{services.base_url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_requests_tokens_and_engine_load(services: RunningServices) -> None:
    ok_key = ("pagedserve_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))
    bad_key = ("pagedserve_requests_total", (("route", "/v1/chat/completions"), ("status", "404")))
    tokens_key = ("pagedserve_generation_tokens_total", (("model", services.model),))
    ttft_key = ("pagedserve_time_to_first_token_seconds_count", (("model", services.model),))
    before = _samples(services)

    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model=services.model,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing-model", messages=[{"role": "user", "content": "x"}])

    after = _samples(services)
    assert after[ok_key] - before.get(ok_key, 0) == 1
    assert after[bad_key] - before.get(bad_key, 0) == 1
    assert after[tokens_key] - before.get(tokens_key, 0) == 5
    assert after[ttft_key] - before.get(ttft_key, 0) == 1
    e2e_key = ("pagedserve_e2e_request_latency_seconds_count", (("model", services.model),))
    itl_key = ("pagedserve_inter_token_latency_seconds_count", (("model", services.model),))
    assert after[e2e_key] - before.get(e2e_key, 0) == 1
    assert 1 <= after[itl_key] - before.get(itl_key, 0) <= 4  # 5 tokens: 4 gaps (fewer if a step sent two)
    for stream in ("req", "gen"):  # queue depth, read from Redis at scrape time: idle now
        assert after[("pagedserve_stream_backlog", (("model", services.model), ("stream", stream)))] == 0
        assert ("pagedserve_stream_pending", (("model", services.model), ("stream", stream))) in after
    load = {labels: v for (name, labels), v in after.items() if name == "pagedserve_engine_kv_blocks"}
    assert len(load) == 1 and next(iter(load.values())) > 0  # one engine, with its KV cache size
    assert ("pagedserve_requests_in_flight", ()) in after


def _service_samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def test_engine_and_tokenizer_export_their_own_metrics(services: RunningServices) -> None:
    assert services.metrics_ports is not None
    engine_port, tokenizer_port = services.metrics_ports["engine"], services.metrics_ports["tokenizer"]
    engine_before, tok_before = _service_samples(engine_port), _service_samples(tokenizer_port)
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0)
    for _ in range(2):  # the same prompt twice: the second finds its full blocks in the prefix cache
        client.completions.create(
            model=services.model, prompt="word " * 40, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=services.model, prompt="x", max_tokens=10**6)
    engine, tok = _service_samples(engine_port), _service_samples(tokenizer_port)

    def grew(after: dict, before: dict, name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    model = services.model
    assert grew(engine, engine_before, "pagedserve_engine_generation_tokens_total", model=model) == 8
    assert grew(engine, engine_before, "pagedserve_engine_steps_total") >= 4
    assert grew(engine, engine_before, "pagedserve_engine_step_duration_seconds_count") >= 4
    assert grew(engine, engine_before, "pagedserve_engine_batch_size_count") >= 4
    assert grew(engine, engine_before, "pagedserve_engine_queue_wait_seconds_count") == 2
    assert grew(engine, engine_before, "pagedserve_engine_stream_wait_seconds_count") == 2
    assert grew(engine, engine_before, "pagedserve_engine_prefix_cache_hits_total") >= 32  # 2 blocks of 16
    assert grew(engine, engine_before, "pagedserve_engine_prefix_cache_queries_total") >= 80
    assert _total(engine, "pagedserve_engine_kv_cache_blocks") > 0
    assert 0.0 <= _total(engine, "pagedserve_engine_kv_cache_usage_ratio") <= 1.0
    for name in (
        "pagedserve_engine_num_running",
        "pagedserve_engine_num_waiting",
        "pagedserve_engine_preemptions_total",
    ):
        assert any(n == name for n, _ in engine), name
    assert grew(tok, tok_before, "pagedserve_tokenizer_requests_total", outcome="accepted") == 2
    assert grew(tok, tok_before, "pagedserve_tokenizer_requests_total", outcome="rejected") == 1
    assert grew(tok, tok_before, "pagedserve_tokenizer_request_duration_seconds_count") == 3
    assert grew(tok, tok_before, "pagedserve_tokenizer_queue_lag_seconds_count") == 3


def test_engine_and_tokenizer_answer_health_and_readiness_probes(services: RunningServices) -> None:
    assert services.metrics_ports is not None
    for port in services.metrics_ports.values():
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
        assert ready.status_code == 200 and ready.json() == {"ready": True}
        assert httpx.get(f"http://127.0.0.1:{port}/nothing", timeout=5).status_code == 404


def test_vllm_compatible_metrics_alongside_ours(services: RunningServices) -> None:
    """The vllm:* series (names and labels as vLLM v1's) count one request as the client saw it."""
    assert services.metrics_ports is not None
    engine_port, model = services.metrics_ports["engine"], services.model
    engine_before, gateway_before = _service_samples(engine_port), _samples(services)
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 5

    def grew(after: dict, before: dict, name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    deadline = time.monotonic() + 5  # the engine updates its counters right after publishing the last step
    while True:
        engine = _service_samples(engine_port)
        if (
            grew(engine, engine_before, "vllm:request_success_total", model_name=model) >= 1
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.05)
    assert grew(engine, engine_before, "vllm:generation_tokens_total", model_name=model) == 5
    assert grew(engine, engine_before, "vllm:prompt_tokens_total", model_name=model) == reply.usage.prompt_tokens
    assert grew(engine, engine_before, "vllm:request_success_total", model_name=model, finished_reason="length") == 1
    assert grew(engine, engine_before, "vllm:request_success_total", model_name=model, finished_reason="stop") == 0
    assert grew(engine, engine_before, "vllm:prefix_cache_queries_total", model_name=model) == reply.usage.prompt_tokens
    assert grew(engine, engine_before, "vllm:prefix_cache_hits_total", model_name=model) >= 0
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        series = [(dict(labels), v) for (n, labels), v in engine.items() if n == gauge]
        assert len(series) == 1, gauge
        labels, value = series[0]
        assert labels["model_name"] == model and labels["engine"], gauge
        assert 0.0 <= value <= (1.0 if gauge == "vllm:kv_cache_usage_perc" else 256), gauge

    gateway = _samples(services)
    label = (("model_name", model),)
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        key = (f"{histogram}_count", label)
        assert gateway[key] - gateway_before.get(key, 0) == 1, histogram
        assert (f"{histogram}_bucket", (("le", "0.001"), ("model_name", model))) in gateway  # buckets from 1 ms
    itl = ("vllm:inter_token_latency_seconds_count", label)
    assert 1 <= gateway[itl] - gateway_before.get(itl, 0) <= 4
    assert ("vllm:inter_token_latency_seconds_bucket", (("le", "0.001"), ("model_name", model))) in gateway
    ours = ("pagedserve_time_to_first_token_seconds_bucket", (("le", "0.001"), ("model", model)))
    assert ours in gateway  # our own histograms start at 1 ms too
