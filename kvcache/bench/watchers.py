"""What watches a cluster during a bench, each in a process of its own, as a real Prometheus and
a real trace collector would be: their work must not share the bench's GIL with the clients it
times (in the bench's process, a scraper reading eleven members once a second cut a tiny model's
measured throughput by a quarter while the members' CPU time per request rose 6%).

Only the standard library here: a spawned process imports this module and nothing heavier (the
sink reads the spans in each export with opentelemetry-proto when the `otel` extra put it there).
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_SPAWN = multiprocessing.get_context("spawn")  # no fork of a process with gRPC's threads


class Scraper:
    """Reads every member's /metrics once a second (Prometheus usually every 15-30 s)."""

    def __init__(self, urls: list[str], interval_s: float = 1.0):
        self._stopping = _SPAWN.Event()
        self._counts = _SPAWN.Array("q", 2)  # scrapes, failures
        self._process = _SPAWN.Process(target=_scrape, args=(urls, interval_s, self._stopping, self._counts),
                                       name="bench-scraper", daemon=True)

    def start(self) -> "Scraper":
        self._process.start()
        return self

    @property
    def scrapes(self) -> int:
        return self._counts[0]

    @property
    def failures(self) -> int:
        return self._counts[1]

    def stop(self) -> None:
        self._stopping.set()
        self._process.join(10.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)
        print(f"metrics: {self.scrapes} scrapes, {self.failures} failed", file=sys.stderr, flush=True)


def _scrape(urls: list[str], interval_s: float, stopping, counts) -> None:
    while not stopping.wait(interval_s):
        for url in urls:
            try:
                with urllib.request.urlopen(url, timeout=5.0) as reply:
                    reply.read()
                counts[0] += 1
            except OSError:
                counts[1] += 1


class SpanSink:
    """An OTLP/HTTP receiver that reads every export and answers 200 (an empty response message);
    with opentelemetry-proto it also counts the spans by service and name (`spans()`), so a bench
    can say how many spans a request made on each role."""

    def __init__(self):
        self._stopping = _SPAWN.Event()
        self._counts = _SPAWN.Array("q", 3)  # port, exports, bytes
        self._ready = _SPAWN.Event()
        self._asking, answering = _SPAWN.Pipe()
        self._process = _SPAWN.Process(target=_sink, args=(self._stopping, self._ready, self._counts, answering),
                                       name="bench-span-sink", daemon=True)
        self.url = ""

    def __enter__(self) -> "SpanSink":
        self._process.start()
        if not self._ready.wait(30.0):
            self._process.kill()
            raise RuntimeError("the span sink did not start within 30 s")
        self.url = f"http://127.0.0.1:{self._counts[0]}/v1/traces"
        return self

    @property
    def exports(self) -> int:
        return self._counts[1]

    @property
    def bytes(self) -> int:
        return self._counts[2]

    def spans(self) -> dict[str, dict[str, int]] | None:
        """Spans received so far, {service: {span name: count}}; None when the sink could not read
        them (no opentelemetry-proto)."""
        self._asking.send("spans")
        if not self._asking.poll(10.0):
            return None
        return self._asking.recv()

    def __exit__(self, *exc) -> None:
        self._stopping.set()
        self._process.join(10.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)


def _span_names(body: bytes, into: dict[str, dict[str, int]]) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
        attributes = resource_spans.resource.attributes
        service = next((a.value.string_value for a in attributes if a.key == "service.name"), "")
        names = into.setdefault(service, {})
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                names[span.name] = names.get(span.name, 0) + 1


def _sink(stopping, ready, counts, answering) -> None:
    lock = threading.Lock()
    try:
        import opentelemetry.proto.collector.trace.v1.trace_service_pb2  # noqa: F401
        spans: dict[str, dict[str, int]] | None = {}
    except ImportError:
        spans = None

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keeps the exporter's connection, as a collector does

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with lock:
                counts[1] += 1
                counts[2] += len(body)
                if spans is not None and self.headers.get("Content-Encoding", "") in ("", "identity"):
                    _span_names(body, spans)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    counts[0] = server.server_port
    threading.Thread(target=server.serve_forever, args=(0.5,), daemon=True).start()
    ready.set()
    while not stopping.wait(0.1):
        if answering.poll():
            answering.recv()
            with lock:
                answering.send(None if spans is None else {k: dict(v) for k, v in spans.items()})
    server.shutdown()
    server.server_close()
