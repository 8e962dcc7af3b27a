"""OpenTelemetry spans of the server's requests; imported only when tracing is on.

Each HTTP request gets a root span (kind SERVER) that continues the W3C `traceparent` the
client sent. Each engine request under it gets, once it ends, the spans of its phases, made
after the fact from the timestamps of its final chunk (`meta_info["timestamps"]`, recorded by
the engine, which may run in another process and exports nothing itself):

    queue       arrival (prepared)  -> first scheduled
    prefill     first scheduled     -> first output token
    decode      first output token  -> last output token
    detokenize  last output token   -> output detokenized on the front end

An engine that reports no timestamps (a phase it never reached, or an engine without them)
leaves those spans out; the root span is there either way.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixlm.sampling import GenerateChunk, GenerateRequest
from radixlm.server._version import __version__

#: Probes and scrapes get no span (they would drown the traces of the requests).
UNTRACED_PATHS = frozenset({"/health", "/metrics"})
#: The phase spans: (name, the timestamp it starts at, the one it ends at).
PHASES = (
    ("queue", "arrival", "scheduled"),
    ("prefill", "scheduled", "first_token"),
    ("decode", "first_token", "last_token"),
    ("detokenize", "last_token", "detokenized"),
)


def otlp_endpoint_url(endpoint: str) -> str:
    """`--otlp-traces-endpoint` as the exporter's URL: `http://` when no scheme is given,
    `/v1/traces` when no path is (OTLP/HTTP's path for traces)."""
    url = endpoint.strip()
    if "://" not in url:
        url = f"http://{url}"
    if urlsplit(url).path in ("", "/"):
        url = url.rstrip("/") + "/v1/traces"
    return url


def otlp_tracer_provider(endpoint: str, service_name: str = "radixlm") -> Any:
    """A TracerProvider exporting to `endpoint` over OTLP/HTTP through a batch span processor
    (spans leave in the background; `shutdown()` flushes them). `OTEL_SERVICE_NAME` and
    `OTEL_RESOURCE_ATTRIBUTES` name the service as usual; else it is `service_name`."""
    import os

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    exporter = OTLPSpanExporter(endpoint=otlp_endpoint_url(endpoint))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


@dataclass
class _HttpTrace:
    """One HTTP request's root span, and what its engine requests add up to (set on the span
    when the response is done: a batch's requests all report here)."""

    span: trace.Span
    request_ids: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)

    def finish(self) -> None:
        if not self.request_ids:
            return
        span = self.span
        span.set_attribute("gen_ai.request.id", ",".join(self.request_ids))
        span.set_attribute("gen_ai.usage.input_tokens", self.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", self.completion_tokens)
        span.set_attribute("radixlm.usage.cached_tokens", self.cached_tokens)
        span.set_attribute("gen_ai.response.finish_reasons", self.finish_reasons)


_CURRENT: contextvars.ContextVar[_HttpTrace | None] = contextvars.ContextVar(
    "radixlm_http_trace", default=None
)


class RequestTracer:
    """The server's spans: `TracingMiddleware` wraps the app (root spans), `record` is called
    by the server once each engine request has ended (its phase spans)."""

    def __init__(self, tracer_provider: Any) -> None:
        self.provider = tracer_provider
        self.tracer = tracer_provider.get_tracer("radixlm.server", __version__)

    def record(
        self, request: GenerateRequest, finals: Mapping[int, GenerateChunk], outcome: str
    ) -> None:
        """Add one ended engine request to its HTTP request's root span (request id, token
        counts, finish reasons) and make its phase spans, children of the root. Nothing when
        it runs outside a traced HTTP request or after its root span ended."""
        http = _CURRENT.get()
        if http is None or not http.span.is_recording():
            return
        rid = str(request.rid)
        ended = [finals[i] for i in sorted(finals)]
        http.request_ids.append(rid)
        if ended:
            http.prompt_tokens += ended[0].prompt_tokens
            http.cached_tokens += ended[0].cached_tokens
        http.completion_tokens += sum(c.completion_tokens for c in ended)
        http.finish_reasons.extend(c.finish_type or "?" for c in ended)
        if len(ended) < request.params.n:
            http.finish_reasons.append(outcome)
        parent = trace.set_span_in_context(http.span)
        for chunk in ended:
            stamps = (chunk.extra or {}).get("timestamps")
            if isinstance(stamps, Mapping):
                self._phases(parent, rid, chunk.index if len(ended) > 1 else None, stamps)

    def _phases(self, parent: Any, rid: str, index: int | None, stamps: Mapping[str, Any]) -> None:
        attributes: dict[str, str | int] = {"gen_ai.request.id": rid}
        if index is not None:
            attributes["radixlm.sequence.index"] = index
        for name, start_key, end_key in PHASES:
            start, end = stamps.get(start_key), stamps.get(end_key)
            if not isinstance(start, int | float) or not isinstance(end, int | float):
                continue
            span = self.tracer.start_span(
                name, context=parent, attributes=attributes, start_time=_ns(start)
            )
            span.end(end_time=_ns(max(start, end)))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class TracingMiddleware:
    """The root span of each HTTP request (but the probes): `{method} {route}`, continuing
    the W3C `traceparent` (and `tracestate`) the client sent; the status code as an
    attribute, an error status for a 5xx or an exception."""

    def __init__(self, app: ASGIApp, tracing: RequestTracer) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope.get("headers") or []
        }
        method = scope.get("method", "GET")
        path = scope["path"]
        # Under the server span of an outer instrumentation when there is one (it continued
        # the traceparent already), else continuing the client's traceparent.
        outer = trace.get_current_span().get_span_context().is_valid
        with self.tracing.tracer.start_as_current_span(
            f"{method} {path}",
            context=None if outer else propagate.extract(carrier),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        ) as span:
            http = _HttpTrace(span)
            token = _CURRENT.set(http)

            async def traced_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            try:
                await self.app(scope, receive, traced_send)
            finally:
                _CURRENT.reset(token)
                template = getattr(scope.get("route"), "path", None)
                if isinstance(template, str):
                    span.update_name(f"{method} {template}")
                    span.set_attribute("http.route", template)
                http.finish()
