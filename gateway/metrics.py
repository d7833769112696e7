"""`kvcache gateway --metrics`: Prometheus text at /metrics on the gateway's own port (as vLLM's
OpenAI server does), from a registry of its own: requests by route and status, their durations
(a stream's until its last event), prompt tokens by where their KV came from and generated
tokens (from each finished request's usage), and the requests running now."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response

from gateway.routes import route_of
from base.observability import DURATION_BUCKETS
from base.generation import Finished

class GatewayMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvcache_gateway_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.duration = Histogram("kvcache_gateway_request_duration_seconds", "Seconds from a request's arrival to "
                                  "its last byte, by route", ["route"], registry=r, buckets=DURATION_BUCKETS)
        self.prompt_tokens = Counter("kvcache_gateway_prompt_tokens", "Prompt tokens of finished requests, by where "
                                     "their KV came from", ["source"], registry=r)
        self.generation_tokens = Counter("kvcache_gateway_generation_tokens", "Tokens generated (usage's "
                                         "completion_tokens)", registry=r)
        self.running = Gauge("kvcache_gateway_running_requests", "Requests being generated now", registry=r)

    def watch(self, upstream) -> None:
        self.running.set_function(lambda: upstream.running)

    def finished(self, done: Finished) -> None:
        u = done.usage
        self.prompt_tokens.labels("local").inc(u.cached_tokens_local)
        self.prompt_tokens.labels("remote").inc(u.cached_tokens_remote)
        self.prompt_tokens.labels("computed").inc(u.computed_tokens)
        self.generation_tokens.inc(u.completion_tokens)

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    def middleware(self) -> list[Middleware]:
        return [Middleware(_Observe, metrics=self)]


class _Observe:
    """ASGI middleware: counts each HTTP request by route (known routes only: bounded labels) and status."""

    def __init__(self, app, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = route_of(scope.get("path", "")) or "other"
        status = 500   # unless a response starts: an app that raised without answering
        started = time.perf_counter()

        async def observed_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.duration.labels(route).observe(time.perf_counter() - started)
