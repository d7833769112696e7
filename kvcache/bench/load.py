"""`kvcache bench load`: the whole cluster under concurrent load, with the cache and without.

Starts a local cluster (or uses --coordinators), then runs one seeded workload (shared system
prompts with Zipf-like popularity, multi-turn sessions, one-off prompts; see workload.py) from N
concurrent clients, twice on the same cluster: once with every request carrying no_cache (no
local reuse, no kvnode lookup, no write-back: every prompt recomputed), then with the cache.
Every figure is shown beside its baseline with the gain; the TTFT p50 gain also with a bootstrap
interval (each pass's requests redrawn), since a p50 of a few dozen requests moves a lot between
runs. Goals: time to first token p50 at least 5x lower with the cache, and at least 80% of prompt
tokens served from cache once warm.

Order: a few uncached warm-up requests (not counted), the no-cache pass, then the cache pass.
The no-cache pass writes nothing, so the cache pass starts cold and its first request of each
prompt family pays full price ("once warm" leaves those out). Every prompt starts with a tag
unique to this run, so pages left on a long-running cluster by earlier runs never count as hits.

The default model is gpt2-small-shape: the tiny preset recomputes a 600-token prompt so cheaply
that fixed per-request costs (the coordinator hop, streaming, page fetches) make up much of its
time to first token (`kvcache bench remote --model tiny` shows warm-from-kvnode only a few times
faster than cold), which would hide what the cache saves on a model worth caching.

With --gateway, each level runs a third pass, with the cache, through `kvcache gateway` (OpenAI's
streamed /v1/completions over HTTP) on a workload of its own tag (so it starts cold too), and the
report puts its TTFT and throughput beside the gRPC cache pass's. Two passes run a minute apart,
and on a shared machine the load drifts between them by more than the HTTP hop costs, so what
the hop adds (goal: under 5 ms at TTFT p50) is measured in pairs at the end of the run: one
cached prompt sent `--gateway-pairs` times over each path back to back, the median of the pairs'
differences (loadrun.paired_ttft). `--gateway local` starts a gateway in front of the local cluster.

A local cluster's workers get `cores / workers` BLAS threads each (--blas-threads): two workers
that each run OpenBLAS's default of one thread per core on two cores made every prefill several
times slower (the threads spin waiting for a core the other worker holds), in both passes alike.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from coordinator.client import ClusterError
from kvcache.bench import observability_cost
from kvcache.bench.loadoptions import add_arguments  # noqa: F401 - the bench's options, for bench/cli.py
from kvcache.bench.loadoptions import check
from kvcache.bench.loadpasses import bench_passes, blas_threads
from kvcache.bench.report import MATPLOTLIB_MISSING, dump_json
from kvcache.bench.watchers import Scraper
from worker.model import load_model_tokenizer

def run(args: argparse.Namespace) -> int:
    try:
        config, levels = check(args)
        tokenizer = load_model_tokenizer(args.model)
    except ValueError as exc:
        print(f"kvcache bench load: error: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            from kvcache.bench.report import pyplot

            pyplot()
        except ImportError:
            print(f"kvcache bench load: error: --plot: {MATPLOTLIB_MISSING}", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so the local cluster is stopped on the way out
    if args.observability_cost:
        try:
            return observability_cost.run(args, config, levels, tokenizer)
        except (ClusterError, TimeoutError, OSError, RuntimeError, ValueError) as exc:
            print(f"kvcache bench load: error: {exc}", file=sys.stderr)
            return 1
    try:
        with _cluster(args) as (coordinators, gateway):
            runs = []
            for number in range(max(1, args.repeat)):
                if args.repeat > 1 and not args.json:
                    print(f"\n== run {number + 1} of {args.repeat} ==")
                runs.append(bench_passes(args, config, levels, coordinators, tokenizer, gateway,
                                         quiet_json=args.repeat > 1))
            if args.repeat > 1:
                _print_repeats(runs, args.json)
            return 0
    except (ClusterError, TimeoutError, OSError, RuntimeError, ValueError) as exc:
        print(f"kvcache bench load: error: {exc}", file=sys.stderr)
        return 1


def _print_repeats(runs: list[dict], as_json: bool) -> None:
    """Each run's TTFT and throughput gains per concurrency level, and their median."""
    summary = []
    for index, level in enumerate(runs[0]["levels"]):
        per_run = [run["levels"][index]["gains"] for run in runs]
        names = ("ttft_p50", "ttft_p90", "ttft_p99", "requests_per_s")
        summary.append({"concurrency": level["concurrency"],
                        "runs": [{name: gains[name] for name in names} for gains in per_run],
                        "median": {name: statistics.median(g[name] for g in per_run) for name in names}})
    if as_json:
        dump_json({"bench": "load", "repeat": len(runs), "runs": runs, "summary": summary})
        return
    print(f"\n== {len(runs)} runs ==")
    for level in summary:
        print(f"{level['concurrency']} clients: gain with the cache (no cache / cache)")
        for number, gains in enumerate(level["runs"], 1):
            print(f"  run {number}: TTFT p50 {gains['ttft_p50']:.2f}x  p90 {gains['ttft_p90']:.2f}x  "
                  f"p99 {gains['ttft_p99']:.2f}x  requests/s {gains['requests_per_s']:.2f}x")
        m = level["median"]
        print(f"  median: TTFT p50 {m['ttft_p50']:.2f}x  p90 {m['ttft_p90']:.2f}x  p99 {m['ttft_p99']:.2f}x  "
              f"requests/s {m['requests_per_s']:.2f}x")


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


# ---- the cluster -------------------------------------------------------------------------


class _cluster:
    """The coordinator addresses: given ones, or a local cluster started here and stopped on exit."""

    def __init__(self, args):
        self.args = args
        self.local = None

    def __enter__(self) -> tuple[list[str], str | None]:
        from kvcache.cluster import start_cluster, wait_healthy

        a = self.args
        if a.coordinators:
            return [c.strip() for c in a.coordinators.split(",") if c.strip()], a.gateway
        logs = Path(a.logs) if a.logs else Path(tempfile.mkdtemp(prefix="kvcache-bench-load-")) / "logs"
        if not (a.json or a.no_progress):
            print(f"starting a local cluster ({a.nodes} kvnodes, {a.workers} workers, model {a.model}); logs in {logs}",
                  file=sys.stderr, flush=True)
        self.local = start_cluster(logs, nodes=a.nodes, workers=a.workers, coordinators=2, replicas=a.replicas,
                                   model=a.model, kv_dtype=a.kv_dtype, node_capacity=a.node_capacity,
                                   worker_kv_cache=a.worker_kv_cache, blas_threads=blas_threads(a),
                                   step_logs=a.step_logs, max_prefill_tokens=a.max_prefill_tokens,
                                   alone_prefill_tokens=a.alone_prefill_tokens,
                                   metrics=a.metrics, gateway_port=0 if a.gateway == "local" else None)
        try:
            wait_healthy(self.local.coordinator_addresses, a.nodes, a.workers, timeout_s=180.0)
        except BaseException:
            self.local.stop()
            raise
        if a.metrics:
            self.scraper = Scraper([d.metrics_url for d in self.local.daemons], a.scrape_interval).start()
        return self.local.coordinator_addresses, self.local.gateway_url if a.gateway == "local" else a.gateway

    def __exit__(self, *exc) -> None:
        if getattr(self, "scraper", None) is not None:
            self.scraper.stop()
        if self.local is not None:
            self.local.stop()
