"""The gateway's Prometheus endpoint counts what it served and shows each engine's load."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import RunningServices


def _samples(services: RunningServices) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{services.base_url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def test_metrics_count_requests_tokens_and_engine_load(services: RunningServices) -> None:
    ok_key = ("pagedserve_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))
    bad_key = ("pagedserve_requests_total", (("route", "/v1/chat/completions"), ("status", "404")))
    tokens_key = ("pagedserve_generation_tokens_total", (("model", services.model),))
    ttft_key = ("pagedserve_time_to_first_token_seconds_count", (("model", services.model),))
    before = _samples(services)

    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model=services.model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5, temperature=0,
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
    load = {labels: v for (name, labels), v in after.items() if name == "pagedserve_engine_kv_blocks"}
    assert len(load) == 1 and next(iter(load.values())) > 0  # one engine, with its KV cache size
    assert ("pagedserve_requests_in_flight", ()) in after
