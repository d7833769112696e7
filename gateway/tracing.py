"""A server span around each HTTP request, while tracing is on (`--otlp-endpoint`).

Its parent is the caller's W3C `traceparent` header when it sends one, so an application that
traces its own calls sees the gateway, coordinator, worker and kvnode spans under them. The span
is current for the whole ASGI call, and the tasks the app starts inherit it, so the gRPC calls
made for the request (coordinator/aio_client.py) carry it on. Installed only when tracing is on:
without it the app runs as before.

Span names are bounded: the method and the route for the gateway's own routes, the method
alone for any other path (a client picks paths; they must not pick span names). Probes and
scrapes (/health, /metrics) make no span, as housekeeping calls make none on the gRPC side."""

from __future__ import annotations

from opentelemetry import propagate, trace

from gateway.routes import route_of
from base.observability import tracer


UNTRACED = ("/health", "/metrics")


class TraceRequests:
    """ASGI middleware: one SERVER span per HTTP request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in UNTRACED:
            return await self.app(scope, receive, send)
        headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope.get("headers", ())
                   if key in (b"traceparent", b"tracestate")}
        method = scope.get("method", "")
        route = route_of(scope.get("path", ""))
        name = f"{method} {route}" if route else method
        status = []

        async def send_status(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        with tracer().start_as_current_span(name, context=propagate.extract(headers),
                                            kind=trace.SpanKind.SERVER) as span:
            span.set_attribute("http.request.method", method)
            if route:
                span.set_attribute("http.route", route)
            try:
                await self.app(scope, receive, send_status)
            finally:
                if status:
                    span.set_attribute("http.response.status_code", status[0])
                    if status[0] >= 500:
                        span.set_status(trace.StatusCode.ERROR)
