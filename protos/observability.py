"""What every daemon shares to be watched: `--metrics-port` (Prometheus text over HTTP, written by
prometheus_client) and tracing with opentelemetry-api (W3C `traceparent` in gRPC metadata).

Design notes
1. Off unless asked: without `--metrics-port` no HTTP server runs and no metric is observed; the
   gRPC interceptors are installed only when metrics or tracing are on, so a daemon without them
   runs the code it ran before.
2. Each daemon has its own CollectorRegistry (not the library's global one), so several daemons in
   one process (tests) keep their numbers apart. Numbers the parts already count (store stats,
   remote tier stats, engine queues) are read when scraped, by a collector, not counted twice.
3. The metrics port listens on the daemon's --host, on TLS with the daemon's certificate when it
   has one, for scrapers holding a `kvcache-monitor` certificate; its connections are bounded in
   number and time, and a peer that connects and sends nothing, or garbage, is dropped by the
   HTTP server's own threads, never reaching the daemon's others (protos/metrics_server.py).
4. Tracing is on when an SDK tracer provider is set: by `--otlp-endpoint` (the `otel` extra) or by
   a test. With the API alone every span is a no-op and channels are not wrapped at all.
   Server spans take their parent from the call's `traceparent`; client channels made while
   tracing is on add it. A streaming handler's span is made current around each step of its
   generator, never across a `yield` (the caller may resume it in another context).
5. The data plane's framing has no room for a trace context: a page transfer shows as the
   worker's fetch or write-back span, not as a span on the node.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from prometheus_client import CollectorRegistry, Histogram

from protos import security
from protos.metrics_server import MetricsServer

log = logging.getLogger(__name__)

# Seconds, from a data plane GET of one small page to a long generation.
DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TRACER_NAME = "kvcache"


def add_arguments(parser) -> None:
    """--metrics-port and --otlp-endpoint, the same for every daemon."""
    parser.add_argument(
        "--metrics-port", type=int, default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics on --host; 0 picks a free port "
             "(default: off)",
    )
    add_tracing_arguments(parser)


def add_tracing_arguments(parser) -> None:
    """--otlp-endpoint alone, for the gateway (its metrics are on its own HTTP port)."""
    parser.add_argument(
        "--otlp-endpoint", default=None, metavar="URL",
        help="export trace spans over OTLP/HTTP to URL (e.g. http://127.0.0.1:4318/v1/traces); needs the "
             "`otel` extra: pip install 'kvcache[otel]' (default: off)",
    )


# ---- metrics -------------------------------------------------------------------


def start_metrics(registry: CollectorRegistry, args, credentials: security.Credentials | None = None
                  ) -> MetricsServer | None:
    """The daemon's metrics server when --metrics-port was given, on TLS with `credentials` (the
    daemon's own); raises OSError/ValueError to report. The daemon stops it on its way out."""
    if getattr(args, "metrics_port", None) is None:
        return None
    return MetricsServer(registry, args.host, args.metrics_port, credentials).start()


def request_histogram(registry: CollectorRegistry, name: str, what: str) -> Histogram:
    return Histogram(name, f"Seconds a {what} gRPC call took, by method", ["method"], registry=registry,
                     buckets=DURATION_BUCKETS)


# ---- tracing -------------------------------------------------------------------


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def tracing_enabled() -> bool:
    """True when an SDK tracer provider is set (design note 4)."""
    return not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def setup_tracing(args, service_name: str) -> bool:
    """Export spans over OTLP when --otlp-endpoint was given; raises ValueError when the `otel`
    extra is not installed. Returns whether tracing is on."""
    endpoint = getattr(args, "otlp_endpoint", None)
    if not endpoint:
        return tracing_enabled()
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ValueError("--otlp-endpoint needs the OpenTelemetry SDK and OTLP exporter, which are not installed: "
                         "pip install 'kvcache[otel]'") from None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    log.info("exporting trace spans over OTLP to %s", endpoint)
    return True


def current_context():
    """The calling thread's trace context, to parent spans made later on another thread."""
    return otel_context.get_current()


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """The current trace context as gRPC metadata (`traceparent`), for grpc.aio calls, which take no
    interceptor here; empty while tracing is off or outside a span."""
    if not tracing_enabled():
        return ()
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def traced_channel(channel: grpc.Channel) -> grpc.Channel:
    """`channel`, adding `traceparent` to every call's metadata while tracing is on (note 4)."""
    if not tracing_enabled():
        return channel
    return grpc.intercept_channel(channel, _InjectContext())


class _InjectContext(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    @staticmethod
    def _details(details):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        if not carrier:
            return details
        metadata = list(details.metadata or ()) + list(carrier.items())
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


class ServerObserver(grpc.ServerInterceptor):
    """Times each call of `service_name` into `histogram` (by method) and, while tracing is on,
    runs it in a server span whose parent is the caller's `traceparent`."""

    def __init__(self, service_name: str, histogram: Histogram | None, trace_calls: bool):
        self.prefix = f"/{service_name}/"
        self.histogram = histogram
        self.trace_calls = trace_calls

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self.prefix):
            return handler
        name = method[len(self.prefix):]
        metadata = handler_call_details.invocation_metadata or ()
        timer = self.histogram.labels(name) if self.histogram is not None else None
        span_name = method[1:] if self.trace_calls else None
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_unary(handler.unary_unary, timer, span_name, metadata))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_unary(handler.stream_unary, timer, span_name, metadata))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_streaming(handler.unary_stream, timer, span_name, metadata))
        return handler._replace(stream_stream=_streaming(handler.stream_stream, timer, span_name, metadata))


def server_interceptors(service_name: str, histogram: Histogram | None) -> list[grpc.ServerInterceptor]:
    """What make_server needs for this daemon: nothing when neither metrics nor tracing is on."""
    trace_calls = tracing_enabled()
    if histogram is None and not trace_calls:
        return []
    return [ServerObserver(service_name, histogram, trace_calls)]


def _parent(metadata):
    return propagate.extract({key: value for key, value in metadata if isinstance(value, str)})


def _unary(behavior: Callable, timer, span_name: str | None, metadata):
    def call(request, context):
        started = time.perf_counter()
        try:
            if span_name is None:
                return behavior(request, context)
            with tracer().start_as_current_span(span_name, context=_parent(metadata), kind=trace.SpanKind.SERVER):
                return behavior(request, context)
        finally:
            if timer is not None:
                timer.observe(time.perf_counter() - started)

    return call


def _streaming(behavior: Callable, timer, span_name: str | None, metadata):
    def call(request, context) -> Iterator:
        started = time.perf_counter()
        span = None
        if span_name is not None:
            span = tracer().start_span(span_name, context=_parent(metadata), kind=trace.SpanKind.SERVER)
        try:
            if span is None:
                yield from behavior(request, context)
                return
            with trace.use_span(span, end_on_exit=False):  # the handler's first step (design note 4)
                replies = iter(behavior(request, context))
            while True:
                with trace.use_span(span, end_on_exit=False):
                    try:
                        reply = next(replies)
                    except StopIteration:
                        return
                yield reply
        finally:
            if span is not None:
                span.end()
            if timer is not None:
                timer.observe(time.perf_counter() - started)

    return call

