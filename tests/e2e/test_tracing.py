"""One request is one trace across gateway, tokenizer and engine, exported over OTLP/HTTP (protobuf)
to a receiver inside the test: W3C traceparent continued from the client, a span for each wait in
a Redis stream, tokenization, engine queueing, prefill and decode, GenAI attributes, a first-token event."""

from __future__ import annotations

import httpx

from tests.conftest import RunningServices

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
EXPECTED = {
    "gateway.generate",
    "tokenizer.process",
    "tokenizer.tokenize",
    "stream.wait",
    "engine.generate",
    "engine.queue",
    "engine.prefill",
    "engine.decode",
}


def test_a_request_is_one_trace_with_every_phase(services: RunningServices) -> None:
    assert services.otlp is not None
    reply = httpx.post(
        f"{services.base_url}/v1/chat/completions",
        timeout=120,
        headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"},
        json={
            "model": services.model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "temperature": 0.5,
            "top_p": 0.9,
            "ignore_eos": True,
        },
    )
    assert reply.status_code == 200
    request_id = reply.json()["id"]
    spans = services.otlp.wait_for(TRACE_ID, EXPECTED)
    names = [s.name for s in spans]
    assert set(names) >= EXPECTED, f"spans of the trace: {sorted(names)}"
    one = {s.name: s for s in spans if s.name != "stream.wait"}
    assert all(names.count(n) == 1 for n in one), names  # one request, one of each
    gateway, tok, tokenize = one["gateway.generate"], one["tokenizer.process"], one["tokenizer.tokenize"]
    engine = one["engine.generate"]

    # Parents: the caller → gateway → tokenizer → engine, each phase under its service's span.
    assert gateway.parent_id == CALLER_SPAN_ID and gateway.service == "pagedserve-gateway"
    assert tok.parent_id == gateway.span_id and tok.service == "pagedserve-tokenizer"
    assert tokenize.parent_id == tok.span_id
    assert engine.parent_id == tok.span_id and engine.service == "pagedserve-engine"
    for phase in ("engine.queue", "engine.prefill", "engine.decode"):
        assert one[phase].parent_id == engine.span_id
    assert one["engine.queue"].end_ns <= one["engine.prefill"].end_ns <= one["engine.decode"].end_ns

    # Stream waits: the request stream (a child of the gateway span) and the engine stream (of the tokenizer's).
    waits = {s.attributes["messaging.destination.name"]: s for s in spans if s.name == "stream.wait"}
    assert set(waits) == {f"ps:{{{services.model}}}:req", f"ps:{{{services.model}}}:gen"}, sorted(waits)
    assert waits[f"ps:{{{services.model}}}:req"].parent_id == gateway.span_id
    assert waits[f"ps:{{{services.model}}}:gen"].parent_id == tok.span_id
    for wait in waits.values():
        assert wait.end_ns >= wait.start_ns and wait.attributes["messaging.system"] == "redis"

    # GenAI semantic conventions.
    usage = reply.json()["usage"]
    assert gateway.attributes["gen_ai.operation.name"] == "chat"
    assert gateway.attributes["gen_ai.request.model"] == services.model
    assert gateway.attributes["gen_ai.request.max_tokens"] == 3
    assert gateway.attributes["gen_ai.request.temperature"] == 0.5
    assert gateway.attributes["gen_ai.request.top_p"] == 0.9
    assert gateway.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert gateway.attributes["gen_ai.usage.output_tokens"] == 3
    assert gateway.attributes["gen_ai.response.id"] == request_id
    assert gateway.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert tokenize.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert engine.attributes["gen_ai.request.model"] == services.model
    assert engine.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert engine.attributes["gen_ai.usage.output_tokens"] == 3
    assert engine.attributes["pagedserve.finish_reason"] == "length"

    # The first token is an event on the gateway's and the engine's spans, inside the prefill→decode boundary.
    for span in (gateway, engine):
        assert [name for name, _ in span.events] == ["gen_ai.first_token"]
