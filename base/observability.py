"""What every daemon shares to be watched: `--metrics-port` (Prometheus text over HTTP, written by
prometheus_client; its server: base/metrics_server.py) and tracing with opentelemetry-api (W3C
`traceparent` in gRPC metadata).

Off unless asked: without `--metrics-port` no HTTP server runs and no metric is observed, and the
gRPC interceptors are installed only when metrics or tracing are on, so a daemon without them runs
the code it ran before. Each daemon has its own CollectorRegistry, not the library's global one, so
several daemons in one process (tests) keep their numbers apart; numbers the parts count anyway
are read when scraped, by a collector, not counted twice. The data plane's framing has no room for
a trace context: a page transfer shows as the worker's fetch or write-back span, not on the node.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Collection, Iterator, NamedTuple

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CollectorRegistry, Histogram

from base import security
from base.metrics_server import MetricsServer

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
    """--otlp-endpoint and --trace-sample-ratio (the gateway takes these alone: its metrics are on
    its own HTTP port)."""
    parser.add_argument(
        "--otlp-endpoint", default=None, metavar="URL",
        help="export trace spans over OTLP/HTTP to URL (e.g. http://127.0.0.1:4318/v1/traces); needs the "
             "`otel` extra: pip install 'kvcache[otel]' (default: off)",
    )
    parser.add_argument(
        "--trace-sample-ratio", type=float, default=None, metavar="R",
        help="with --otlp-endpoint: the share of requests traced, 0 to 1, decided where a request's trace "
             "starts and followed by every daemon it reaches; a request not sampled makes no span anywhere "
             "(default 1.0, every request, unless the OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG "
             "environment variables choose another sampler)",
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


_tracer: tuple[object, trace.Tracer | None] = (None, None)  # (provider, its tracer)


def tracer() -> trace.Tracer:
    """The daemon's tracer, kept while the provider stays the same (get_tracer costs about as much
    as making a span)."""
    global _tracer
    provider = trace.get_tracer_provider()
    known, kept = _tracer
    if known is not provider or kept is None:
        kept = trace.get_tracer(TRACER_NAME, tracer_provider=provider)
        _tracer = (provider, kept)
    return kept


def sampled(context) -> bool:
    """Whether `context` (a captured trace context, or None) holds a span of a sampled trace: what
    decides if work done later for the same request makes spans. Sampling is decided once, where
    the trace starts (`--trace-sample-ratio`, else the SDK's OTEL_TRACES_SAMPLER), and followed
    downstream: nothing is recorded or exported anywhere for a request not sampled."""
    return context is not None and trace.get_current_span(context).get_span_context().trace_flags.sampled


def tracing_enabled() -> bool:
    """True when an SDK tracer provider is set (by --otlp-endpoint, or a test). With the API alone
    every span is a no-op and channels are not wrapped at all."""
    return not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def setup_tracing(args, service_name: str) -> bool:
    """Export spans over OTLP when --otlp-endpoint was given; raises ValueError when the `otel`
    extra is not installed. Returns whether tracing is on."""
    endpoint = getattr(args, "otlp_endpoint", None)
    ratio = getattr(args, "trace_sample_ratio", None)
    if ratio is not None and not 0.0 <= ratio <= 1.0:
        raise ValueError(f"--trace-sample-ratio must be between 0 and 1 (the share of requests traced), got {ratio}")
    if not endpoint:
        if ratio is not None:
            raise ValueError("--trace-sample-ratio chooses which requests --otlp-endpoint exports: give both, "
                             "or neither")
        return tracing_enabled()
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError:
        raise ValueError("--otlp-endpoint needs the OpenTelemetry SDK and OTLP exporter, which are not installed: "
                         "pip install 'kvcache[otel]'") from None
    # Without the option the SDK picks the sampler from OTEL_TRACES_SAMPLER (default: every trace).
    sampler = ParentBased(TraceIdRatioBased(ratio)) if ratio is not None else None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    log.info("exporting trace spans over OTLP to %s (sampler: %s)", endpoint, provider.sampler.get_description())
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
    """`channel`, adding `traceparent` to every call's metadata while tracing is on, and only inside
    a trace."""
    if not tracing_enabled():
        return channel
    return grpc.intercept_channel(channel, _InjectContext())


class _InjectContext(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    @staticmethod
    def _details(details):
        if not trace.get_current_span().get_span_context().is_valid:  # outside a trace: nothing to carry
            return details
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
    runs it in a server span whose parent is the caller's `traceparent`, or a new trace for the
    methods in `trace_roots`.

    Spans only for requests: a trace starts at a service's entry methods (Generate on coordinators
    and workers) when the call brings none; any other call gets a server span only inside a
    caller's sampled trace, and runs under an unsampled caller's context without one, so its own
    calls carry that context on. So heartbeats, registrations, Info and Stats polls and health
    checks make no span (each heartbeat was a trace of its own before), and a kvnode's spans all
    sit in a request's trace."""

    def __init__(self, service_name: str, histogram: Histogram | None, trace_calls: bool,
                 trace_roots: Collection[str] = ()):
        self.prefix = f"/{service_name}/"
        self.histogram = histogram
        self.trace_calls = trace_calls
        self.trace_roots = frozenset(trace_roots)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self.prefix):
            return handler
        name = method[len(self.prefix):]
        timer = self.histogram.labels(name) if self.histogram is not None else None
        traced = None
        if self.trace_calls:
            traced = _call_trace(handler_call_details.invocation_metadata or (), name in self.trace_roots, method[1:])
        if timer is None and traced is None:
            return handler
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_unary(handler.unary_unary, timer, traced))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_unary(handler.stream_unary, timer, traced))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_streaming(handler.unary_stream, timer, traced))
        return handler._replace(stream_stream=_streaming(handler.stream_stream, timer, traced))


def server_interceptors(service_name: str, histogram: Histogram | None,
                        trace_roots: Collection[str] = ()) -> list[grpc.ServerInterceptor]:
    """What make_server needs for this daemon: nothing when neither metrics nor tracing is on.
    `trace_roots`: the methods that start a trace when the caller sends none (see ServerObserver)."""
    trace_calls = tracing_enabled()
    if histogram is None and not trace_calls:
        return []
    return [ServerObserver(service_name, histogram, trace_calls, trace_roots)]


class _Traced(NamedTuple):
    """How one call is traced: a server span named `span_name` under `context` (None: a new
    trace), or, without `span_name`, the caller's unsampled `context` made current, so the calls
    it makes carry the unsampled context on."""
    span_name: str | None
    context: object


def _call_trace(metadata, may_start: bool, span_name: str) -> _Traced | None:
    fields = _propagated_fields()
    carried = {key: value for key, value in metadata if key in fields and isinstance(value, str)}
    if carried:
        parent = propagate.extract(carried)
        span_context = trace.get_current_span(parent).get_span_context()
        if span_context.is_valid:
            return _Traced(span_name if span_context.trace_flags.sampled else None, parent)
    return _Traced(span_name, None) if may_start else None


_fields: tuple[object, frozenset[str]] = (None, frozenset())


def _propagated_fields() -> frozenset[str]:
    """The metadata keys the configured propagators read (traceparent, tracestate, baggage)."""
    global _fields
    propagator = propagate.get_global_textmap()
    if _fields[0] is not propagator:
        _fields = (propagator, frozenset(propagator.fields))
    return _fields[1]


def _unary(behavior: Callable, timer, traced: _Traced | None):
    def call(request, context):
        started = time.perf_counter()
        try:
            if traced is None:
                return behavior(request, context)
            if traced.span_name is None:
                token = otel_context.attach(traced.context)
                try:
                    return behavior(request, context)
                finally:
                    otel_context.detach(token)
            with tracer().start_as_current_span(traced.span_name, context=traced.context, kind=trace.SpanKind.SERVER):
                return behavior(request, context)
        finally:
            if timer is not None:
                timer.observe(time.perf_counter() - started)

    return call


def _streaming(behavior: Callable, timer, traced: _Traced | None):
    def call(request, context) -> Iterator:
        started = time.perf_counter()
        span = None
        try:
            if traced is None:
                yield from behavior(request, context)
                return
            current = traced.context
            if traced.span_name is not None:
                span = tracer().start_span(traced.span_name, context=current, kind=trace.SpanKind.SERVER)
                current = trace.set_span_in_context(span, current)
            replies = _step(current, span, lambda: iter(behavior(request, context)))  # the handler's first step
            while True:
                try:
                    reply = _step(current, span, lambda: next(replies))
                except StopIteration:
                    return
                yield reply  # never inside the context: the caller may resume the generator in another
        finally:
            if span is not None:
                span.end()
            if timer is not None:
                timer.observe(time.perf_counter() - started)

    return call


def _step(current, span, step: Callable):
    """step() with `current` as the thread's context; an error on the way out is recorded on
    `span`, as start_as_current_span does for unary calls."""
    token = otel_context.attach(current)
    try:
        return step()
    except StopIteration:
        raise
    except Exception as exc:
        if span is not None and span.is_recording():
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        otel_context.detach(token)
