"""`kvcache bench load --observability-cost`: what metrics and tracing cost, on and off in one run.

Two local clusters of the same shape run side by side: "off" as `cluster up --no-metrics` would
start it, "on" with every member serving --metrics-port (scraped once a second while it runs, more
often than Prometheus' usual 15-30 s) and exporting trace spans over OTLP (--otlp-endpoint) to a
sink in this process that reads each export and answers it, as a collector would. The load bench's
passes (no cache, then cache, on a fresh workload tag each time) alternate between them: off, on,
off, on, ... --repeat pairs. Each pair gives the ratio of throughput on/off for each pass, and the
median of the pairs is the figure, with every pair printed so the machine's noise can be seen;
the load average before each arm is printed beside it. Without the `otel` extra the "on" arm
runs metrics alone and says so.

The idle cluster is not scraped and exports nothing while the other runs; its heartbeats (one a
second per member) are all it costs the other.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kvcache.bench.report import dump_json, machine, versions

ARMS = ("off", "on")
PASSES = ("no_cache", "cache")
GOAL = 0.02  # at most this share of throughput lost with metrics and tracing on


def tracing_available() -> bool:
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


class SpanSink:
    """An OTLP/HTTP receiver that reads every export and answers 200 (an empty response message)."""

    def __init__(self):
        sink = self
        self.exports = self.bytes = 0
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with sink._lock:
                    sink.exports += 1
                    sink.bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.5,), name="span-sink", daemon=True)

    def __enter__(self) -> "SpanSink":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def run(args: argparse.Namespace, config, levels: list[int], tokenizer) -> int:
    from kvcache.bench.load import Scraper, _bench, _blas_threads
    from kvcache.cluster import start_cluster, wait_healthy

    say = (lambda m: None) if args.no_progress else (lambda m: print(m, file=sys.stderr, flush=True))
    tracing = tracing_available()
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="kvcache-bench-cost-"))
    quiet = argparse.Namespace(**{**vars(args), "json": True, "no_progress": True, "plot": None})
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(SpanSink()) if tracing else None
        clusters = {}
        for arm in ARMS:
            say(f"starting the '{arm}' cluster ({args.nodes} kvnodes, {args.workers} workers, model {args.model}); "
                f"logs in {logs / arm}")
            clusters[arm] = stack.enter_context(start_cluster(
                logs / arm, nodes=args.nodes, workers=args.workers, coordinators=2, replicas=args.replicas,
                model=args.model, kv_dtype=args.kv_dtype, node_capacity=args.node_capacity,
                worker_kv_cache=args.worker_kv_cache, blas_threads=_blas_threads(args),
                max_prefill_tokens=args.max_prefill_tokens, metrics=arm == "on",
                otlp_endpoint=sink.url if arm == "on" and sink is not None else None))
        for cluster in clusters.values():
            wait_healthy(cluster.coordinator_addresses, args.nodes, args.workers, timeout_s=180.0)
        pairs = []
        for number in range(args.repeat):
            pair = {}
            for arm in ARMS:
                load = os.getloadavg()[0]
                scraper = Scraper([d.metrics_url for d in clusters[arm].daemons]).start() if arm == "on" else None
                try:
                    result = _bench(quiet, config, levels, clusters[arm].coordinator_addresses, tokenizer,
                                    quiet_json=True)
                finally:
                    if scraper is not None:
                        scraper.stop()
                pair[arm] = {"load_average": load, "levels": [
                    {p: level["passes"][p]["summary"] for p in PASSES} for level in result["levels"]]}
                say(f"pair {number + 1}/{args.repeat} {arm}: " + "; ".join(
                    f"{lv} clients " + ", ".join(f"{p.replace('_', '-')} {s[p]['requests_per_s']:.2f} req/s"
                                                 for p in PASSES)
                    for lv, s in zip(levels, pair[arm]["levels"])) + f" (load average {load:.1f})")
            pairs.append(pair)
        spans = {"exports": sink.exports, "bytes": sink.bytes} if sink is not None else None
    report = _report(pairs, levels, tracing, spans)
    if args.json:
        dump_json({"bench": "load-observability-cost", "machine": machine(), "versions": versions(),
                   "options": {k: v for k, v in vars(args).items() if k != "run"}, **report})
    else:
        _print(report, levels)
    return 0


def _report(pairs: list[dict], levels: list[int], tracing: bool, spans: dict | None) -> dict:
    summary = []
    for index, level in enumerate(levels):
        ratios = {p: [pair["on"]["levels"][index][p]["requests_per_s"] /
                      pair["off"]["levels"][index][p]["requests_per_s"] for pair in pairs] for p in PASSES}
        medians = {p: statistics.median(r) for p, r in ratios.items()}
        summary.append({"concurrency": level, "ratios_on_off": ratios, "median": medians,
                        "goal_met": {p: m >= 1 - GOAL for p, m in medians.items()}})
    return {"arms": {"off": "no --metrics-port, no tracing",
                     "on": "--metrics-port scraped once a second" + (", spans over OTLP to a sink" if tracing
                                                                       else "; tracing not measured (no otel extra)")},
            "tracing_measured": tracing, "spans_exported": spans, "pairs": pairs, "summary": summary, "goal": GOAL}


def _print(report: dict, levels: list[int]) -> None:
    print(f"on: {report['arms']['on']}; off: {report['arms']['off']}")
    if report["spans_exported"]:
        s = report["spans_exported"]
        print(f"spans: {s['exports']} OTLP exports, {s['bytes'] / 1e6:.1f} MB")
    for index, level in enumerate(report["summary"]):
        print(f"{level['concurrency']} clients: throughput on / off (requests/s), pairs run off then on")
        for number, pair in enumerate(report["pairs"]):
            cells = []
            for p in PASSES:
                off, on = (pair[arm]["levels"][index][p]["requests_per_s"] for arm in ARMS)
                cells.append(f"{p.replace('_', '-')} {on:.2f}/{off:.2f} = {on / off:.3f}")
            print(f"  pair {number + 1}: " + "  ".join(cells) +
                  f"  (load average {pair['off']['load_average']:.1f}, {pair['on']['load_average']:.1f})")
        m = level["median"]
        print("  median: " + "  ".join(
            f"{p.replace('_', '-')} {m[p]:.3f} ({(1 - m[p]) * 100:+.1f}% cost, goal under {report['goal'] * 100:.0f}%"
            f"{': met' if level['goal_met'][p] else ': not met'})" for p in PASSES))
