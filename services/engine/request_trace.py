"""The spans of one request inside an engine: generate ⊃ queue → prefill → decode, and a first-token event.

    engine.generate  (gen_ai.* request and usage attributes)
     ├─ engine.queue    arrival at the engine → first scheduled step (waiting for room)
     ├─ engine.prefill  first scheduled step → first token (prompt, in chunks if long)
     └─ engine.decode   first token → finish

Phases advance from the compute loop (`admitted`, `first_token`, `finish`): a few attribute
writes per request per phase, nothing per token.
"""

from __future__ import annotations

import time

from opentelemetry.trace import Span, Status, StatusCode, set_span_in_context

from pagedserve.shared import telemetry
from pagedserve.shared.protocol import GenerateRequest


class RequestTrace:
    def __init__(self, req: GenerateRequest, engine_id: str) -> None:
        self.arrived = time.monotonic()
        self.is_admitted = False
        self.has_first_token = False
        self._tracer = telemetry.tracer(__name__)
        attrs = telemetry.genai_request_attributes("generate", req.model, req.sampling)
        attrs.update(
            {
                "pagedserve.request_id": req.request_id,
                "pagedserve.engine_id": engine_id,
                "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
                "pagedserve.continued_tokens": len(req.output_token_ids),
            }
        )
        self.span: Span = self._tracer.start_span(
            "engine.generate", context=telemetry.context_from(req.traceparent), attributes=attrs
        )
        self._phase: Span = self._child("engine.queue")

    def _child(self, name: str) -> Span:
        return self._tracer.start_span(name, context=set_span_in_context(self.span))

    def admitted(self) -> float:
        """The request was scheduled for the first time; returns its queue wait in seconds."""
        self.is_admitted = True
        self._phase.end()
        self._phase = self._child("engine.prefill")
        return time.monotonic() - self.arrived

    def first_token(self) -> None:
        if not self.is_admitted:  # admitted and finished its prefill within one step
            self.admitted()
        self.has_first_token = True
        self._phase.end()
        self.span.add_event("gen_ai.first_token", {"pagedserve.ttft_engine_s": time.monotonic() - self.arrived})
        self._phase = self._child("engine.decode")

    def finish(self, finish_reason: str | None, output_tokens: int, cached_tokens: int) -> None:
        self._phase.end()
        self.span.set_attributes(
            {
                "gen_ai.response.finish_reasons": [finish_reason or "none"],
                "gen_ai.usage.output_tokens": output_tokens,
                "pagedserve.finish_reason": finish_reason or "none",
                "pagedserve.cached_tokens": cached_tokens,
            }
        )
        self.span.end()

    def fail(self, message: str) -> None:
        self._phase.end()
        self.span.set_status(Status(StatusCode.ERROR, message))
        self.span.end()
