"""OpenTelemetry traces (`--otlp-traces-endpoint`, vLLM's flag): one span per generation,
embedding or scoring request, `llm_request`, exported over OTLP/HTTP by the opentelemetry
SDK (the `otel` extra; imported only when the flag is set, so nothing is exported or
loaded without it). A client's W3C `traceparent` makes the span its child. The span
carries the GenAI semantic conventions' attributes (model, token counts, finish reasons,
sampling parameters) and vLLM's latency ones (time to first token, time in queue, end to
end); its events are the scheduler's (queued, admitted, prefill_chunk, preempted:
tidal/engine/request_events.py), then the first token and the end, with their times."""

from __future__ import annotations

import time
from typing import Any, Mapping

SPAN_NAME = "llm_request"
# gen_ai.operation.name by request body (the GenAI conventions name no reranking: tidal's)
_OPERATIONS = {"CompletionRequest": "text_completion", "EmbeddingRequest": "embeddings",
               "ScoreRequest": "rerank", "RerankRequest": "rerank"}


def operation_of(body) -> str:
    """The span's gen_ai.operation.name for a request body (chat's unless listed)."""
    return _OPERATIONS.get(type(body).__name__, "chat")


class Tracing:
    """The tracer provider and its exporter to `endpoint` (an OTLP/HTTP traces URL, e.g.
    http://localhost:4318/v1/traces); `start` opens a request's span."""

    def __init__(self, endpoint: str, service: str = "tidal",
                 schedule_delay_ms: int = 1000) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise ValueError(f"--otlp-traces-endpoint needs the opentelemetry SDK and its OTLP "
                             f"exporter: pip install 'tidal[otel]' ({exc})") from None
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self.provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=schedule_delay_ms))
        self.tracer = self.provider.get_tracer("tidal")

    def start(self, headers: Mapping[str, str], operation: str, model: str,
              request: dict[str, Any], input_tokens: int) -> "RequestSpan":
        return RequestSpan(self.tracer, headers, operation, model, request, input_tokens)

    def shutdown(self) -> None:
        """Export what is left (the server's shutdown)."""
        self.provider.shutdown()


class RequestSpan:
    """One request's span, from its arrival to its answer; `end` closes it once."""

    def __init__(self, tracer, headers: Mapping[str, str], operation: str, model: str,
                 request: dict[str, Any], input_tokens: int) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(carrier=dict(headers))
        self.start_time = time.time()
        attributes = {"gen_ai.operation.name": operation, "gen_ai.provider.name": "tidal",
                      "gen_ai.request.model": model, "gen_ai.response.model": model,
                      "gen_ai.usage.input_tokens": input_tokens}
        attributes.update({f"gen_ai.request.{k}": v for k, v in request.items()
                           if v is not None})
        self.span = tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER,
                                      attributes=attributes,
                                      start_time=int(self.start_time * 1e9))
        self.output_tokens = 0
        self.first: float | None = None
        self.queued: float | None = None
        self.admitted: float | None = None
        self.reasons: list[str] = []
        self.ended = False

    def update(self, events: list | None, new_tokens: int, finish_reason: str | None) -> None:
        """What one update of the request brought: the scheduler's events, tokens, an end."""
        for name, at, attributes in events or ():
            self.span.add_event(name, attributes, timestamp=int(at * 1e9))
            if name == "queued":
                self.queued = at
            elif name == "admitted" and self.admitted is None:
                self.admitted = at
        now = time.time()
        if new_tokens and self.first is None:
            self.first = now
            self.span.add_event("first_token", {}, timestamp=int(now * 1e9))
        self.output_tokens += new_tokens
        if finish_reason is not None:
            self.reasons.append(finish_reason)

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        now = time.time()
        span = self.span
        span.add_event("finished", {}, timestamp=int(now * 1e9))
        span.set_attribute("gen_ai.usage.output_tokens", self.output_tokens)
        span.set_attribute("gen_ai.response.finish_reasons", self.reasons or ["abort"])
        span.set_attribute("gen_ai.latency.e2e", now - self.start_time)
        if self.first is not None:
            span.set_attribute("gen_ai.latency.time_to_first_token", self.first - self.start_time)
        if self.queued is not None and self.admitted is not None:
            span.set_attribute("gen_ai.latency.time_in_queue", self.admitted - self.queued)
        span.end(end_time=int(now * 1e9))
