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
import uuid
from pathlib import Path

from coordinator.client import Client, ClusterError
from kvcache.bench import observability_cost
from kvcache.bench import workload as wl
from kvcache.bench.loadoptions import add_arguments  # noqa: F401 - the bench's options, for bench/cli.py
from kvcache.bench.loadoptions import check, check_positions
from kvcache.bench.loadrun import PassRun, paired_ttft, run_pass, warm_up
from kvcache.bench.loadreport import plot_charts, print_report
from kvcache.bench.report import MATPLOTLIB_MISSING, dump_json, machine, versions
from kvcache.bench.watchers import Scraper
from kvcache.bench.stats import gain, gain_interval, summarize_pass
from kvcache.cluster import default_blas_threads
from worker.model import load_model_tokenizer
from worker.model.tokenizer import Tokenizer

TTFT_GOAL = 5.0
GATEWAY_TTFT_GOAL_MS = 5.0
WARM_SHARE_GOAL = 0.80


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
                runs.append(_bench(args, config, levels, coordinators, tokenizer, gateway,
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


def _bench(args, config: wl.WorkloadConfig, levels: list[int], coordinators: list[str], tokenizer: Tokenizer,
           gateway: str | None = None, quiet_json: bool = False) -> dict:
    members = _members(coordinators)
    check_positions(config, args, members["worker_limits"])
    if members["model"] != (Path(args.model).name or args.model):
        raise ValueError(f"the cluster's workers run {members['model']}, not --model {args.model}: give the model "
                         "they run (session turns are sent as its token ids)")
    run_id = uuid.uuid4().hex[:6]
    warmup = args.warmup if args.warmup is not None else 2 * len(members["workers"])
    say = (lambda *a: None) if args.json or args.no_progress else (lambda m: print(m, file=sys.stderr, flush=True))
    say(f"cluster: {len(members['nodes'])} kvnodes, {len(members['workers'])} workers, model {members['model']}")
    warm_up(coordinators, warmup, args.max_tokens, run_id)
    result = {
        "bench": "load",
        "machine": machine(),
        "versions": versions(),
        "options": {k: v for k, v in vars(args).items() if k != "run"},
        "workload": {**config.__dict__, "mix": list(config.mix)},
        "cluster": {"started_here": args.coordinators is None, "coordinators": coordinators,
                    "blas_threads_per_worker": _blas_threads(args) if args.coordinators is None else None,
                    "nodes": members["nodes"], "workers": members["workers"], "model": members["model"],
                    "gateway": gateway},
        "order": f"{warmup} uncached warm-up requests (not counted), then per concurrency level the no-cache "
                 "pass, then the cache pass (which starts cold: the no-cache pass writes nothing)",
        "goals": {"ttft_p50_gain": TTFT_GOAL, "cached_share_once_warm": WARM_SHARE_GOAL},
        "levels": [],
    }
    for level in levels:
        tag = f"{run_id}.{level} "  # short: a family's number must fall in the first page
        jobs = wl.build_workload(config, tag)
        passes = {}
        for name, no_cache in (("no_cache", True), ("cache", False)):
            run_ = PassRun(coordinators, members["nodes"], members["workers"], level, no_cache, args.max_tokens,
                           args.duration, tokenizer, progress=not (args.json or args.no_progress))
            results, wall_s, nodes, workers = run_pass(run_, jobs, f"{name.replace('_', '-')} pass, {level} clients")
            passes[name] = {"summary": summarize_pass(results, wall_s), "nodes": nodes, "workers": workers,
                            "ttft_ms_all": [round(r.ttft_ms, 3) for r in results if r.ok]}
        if gateway:
            gateway_jobs = wl.build_workload(config, f"{run_id}.{level}h ")
            run_ = PassRun(coordinators, members["nodes"], members["workers"], level, False, args.max_tokens,
                           args.duration, tokenizer, progress=not (args.json or args.no_progress), gateway=gateway,
                           model=members["model"])
            results, wall_s, nodes, workers = run_pass(run_, gateway_jobs, f"gateway pass, {level} clients")
            passes["gateway"] = {"summary": summarize_pass(results, wall_s), "nodes": nodes, "workers": workers,
                                 "ttft_ms_all": [round(r.ttft_ms, 3) for r in results if r.ok]}
        result["levels"].append(_level(level, tag, jobs, passes))
    if gateway:
        prompt = f"{run_id} paired: " + "the same question over gRPC and over HTTP, one after the other. " * 3
        paired = paired_ttft(coordinators, gateway, members["model"], prompt, args.gateway_pairs, args.max_tokens)
        result["gateway_paired"] = {**paired, "goal_ms": GATEWAY_TTFT_GOAL_MS,
                                    "goal_met": paired["added_ms_p50"] < GATEWAY_TTFT_GOAL_MS}
    if args.plot:
        result["plots"] = plot_charts(result, Path(args.plot))
    if not args.json:
        print_report(result)
    elif not quiet_json:
        dump_json(result)
    return result


def _level(level: int, tag: str, jobs: list[wl.Job], passes: dict) -> dict:
    requests = wl.all_requests(jobs)
    cache, base = passes["cache"]["summary"], passes["no_cache"]["summary"]
    gains = {
        "requests_per_s": gain(cache["requests_per_s"], base["requests_per_s"], False),
        "generated_tokens_per_s": gain(cache["generated_tokens_per_s"], base["generated_tokens_per_s"], False),
        **{f"ttft_{p}": gain(cache["ttft_ms"][p], base["ttft_ms"][p], True) for p in cache["ttft_ms"]},
        **{f"latency_{p}": gain(cache["latency_ms"][p], base["latency_ms"][p], True) for p in cache["latency_ms"]},
    }
    evicted = sum(n["evictions"] for n in passes["cache"]["nodes"].values())
    through_gateway = None
    if "gateway" in passes:
        http = passes["gateway"]["summary"]
        added = http["ttft_ms"]["p50"] - cache["ttft_ms"]["p50"]
        through_gateway = {"ttft_p50_ms": http["ttft_ms"]["p50"], "grpc_ttft_p50_ms": cache["ttft_ms"]["p50"],
                           "ttft_p50_added_ms": added,
                           "requests_per_s": http["requests_per_s"], "grpc_requests_per_s": cache["requests_per_s"]}
    interval = gain_interval(passes["cache"]["ttft_ms_all"], passes["no_cache"]["ttft_ms_all"])
    return {
        "concurrency": level,
        "tag": tag,
        "requests_by_kind": {k: sum(r.kind == k for r in requests) for k in wl.KINDS},
        "families": len({r.family for r in requests}),
        "passes": passes,
        "gains": gains,
        "ttft_p50_gain_interval": {"level": 0.9, "low": interval[0], "high": interval[1]},
        "pages_evicted": evicted,
        **({"gateway": through_gateway} if through_gateway else {}),
        "goals_met": {"ttft_p50_gain": gains["ttft_p50"] >= TTFT_GOAL,
                      "cached_share_once_warm": cache["cache_once_warm"]["total"] >= WARM_SHARE_GOAL},
    }


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
                                   worker_kv_cache=a.worker_kv_cache, blas_threads=_blas_threads(a),
                                   step_logs=a.step_logs, max_prefill_tokens=a.max_prefill_tokens,
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


def _blas_threads(args) -> int:
    return args.blas_threads or default_blas_threads(args.workers)


def _members(coordinators: list[str]) -> dict:
    from worker.client import WorkerClient

    with Client(coordinators) as client:
        status = client.status()
    alive = [m for m in status.members if m.alive]
    nodes = sorted(m.address for m in alive if m.role == "node")
    workers = sorted(m.address for m in alive if m.role == "worker")
    if not workers:
        raise RuntimeError("the cluster has no live worker")
    limits = []
    for address in workers:
        with WorkerClient(address) as worker:
            info = worker.info()
        limits.append((info.max_positions, info.max_tokens_limit))
    models = sorted({m.model for m in alive if m.role == "worker"})
    return {"nodes": nodes, "workers": workers, "model": ",".join(models), "worker_limits": limits}
