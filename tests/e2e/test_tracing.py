"""One trace covers a request's path through gateway, tokenizer and engine (W3C traceparent)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from tests.conftest import RunningServices

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"


def _spans(services: RunningServices, name: str) -> list[dict[str, Any]]:
    """The console-exported spans in a service's log (JSON objects printed one after another)."""
    text = (services.log_dir / f"{name}.log").read_text()
    decoder, spans, i = json.JSONDecoder(), [], 0
    while (i := text.find('{\n    "name"', i)) >= 0:
        span, end = decoder.raw_decode(text, i)
        spans.append(span)
        i = end
    return spans


def test_a_request_is_one_trace_across_the_services(services: RunningServices) -> None:
    reply = httpx.post(
        f"{services.base_url}/v1/chat/completions", timeout=120,
        headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"},
        json={"model": services.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    )
    assert reply.status_code == 200
    request_id = reply.json()["id"]
    found: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + 10
    while len(found) < 3 and time.monotonic() < deadline:
        for service, span_name in (("gateway", "gateway.generate"), ("tokenizer", "tokenizer.process"),
                                   ("engine", "engine.generate")):
            for span in _spans(services, service):
                if span["name"] == span_name and span["context"]["trace_id"] == f"0x{TRACE_ID}":
                    found[service] = span
        time.sleep(0.2)
    assert set(found) == {"gateway", "tokenizer", "engine"}, f"spans of the trace seen in: {sorted(found)}"
    gateway, tokenizer, engine = found["gateway"], found["tokenizer"], found["engine"]
    assert gateway["parent_id"] == f"0x{CALLER_SPAN_ID}"  # continues the caller's trace
    assert tokenizer["parent_id"] == gateway["context"]["span_id"]
    assert engine["parent_id"] == tokenizer["context"]["span_id"]
    assert gateway["attributes"]["pagedserve.request_id"] == request_id
    assert gateway["attributes"]["pagedserve.completion_tokens"] == 3
    assert engine["attributes"]["pagedserve.finish_reason"] == "length"
