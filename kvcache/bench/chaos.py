"""`kvcache bench chaos`: faults under load; every request must still finish with the right tokens.

Starts a local cluster, sends a fixed set of requests once on the undisturbed cluster for the
reference answers (prompts in families sharing a long prefix, each greedy and seeded at
temperature 0.8, end-of-text ignored), then sends the same requests round and round from
--concurrency clients through the coordinators (the cluster client fails over between them)
for --duration seconds while taking members down on a schedule: SIGKILL a worker, a kvnode, a
coordinator, SIGTERM a worker (it drains), each started again on its port. A request refused
with RESOURCE_EXHAUSTED is sent again after a bounded backoff.

Prints: faults injected by kind; requests sent, completed, refused and retried, failed (with the
first errors), and differing from the reference (token ids compared; the first differing
position); members the coordinators marked dead that the bench had not taken down (ClusterStatus
polls and the coordinators' "missed its heartbeats" lines). Then the goal line, failed 0 and
differing 0, PASS or FAIL; the exit code is 0 either way once the bench ran. Every process it
starts is stopped at the end, also on Ctrl-C, SIGTERM or an error.

--eviction runs the kvnodes with another policy (a small --node-capacity makes them evict).
--load N runs N busy processes beside the cluster for the whole run (kvcache/bench/busy.py): a
machine short of cores, as when other work shares it.
--kv-dtype float16, before workers had invariant numerics (worker/model/invariant.py, now their
default): seeded answers differed from the reference, greedy ones did not in any run: K/V
computed in another chunking (a prefix cached by another request, a resumed stream's tokens
recomputed as a prompt) differed in float32's last bits, which rounding to float16 turned into
one float16 step in ~0.5% of the elements, enough to move a seeded draw that falls on a near-tie
(19 of 303 and 1 of 166 seeded requests in two 150 s runs). With them, none (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from base.pages import KV_DTYPES
from kvcache.bench import chaosreport as report
from kvcache.bench.busy import busy_processes, running as busy_running
from kvcache.bench.chaosfaults import KINDS, FaultInjector
from kvcache.bench.chaosload import SEEDED_TEMPERATURE, build_requests, run_clients
from kvcache.bench.chaoswatch import StatusWatcher, log_sightings, resumed_streams, wrongly_dead
from kvcache.bench.report import dump_json, machine, versions
from kvcache.cluster import LocalCluster, start_cluster, wait_healthy
from kvcache.launch import DaemonFailed
from kvcache.model_pages import MODELS
from kvnode.eviction import NODE_POLICIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cluster = parser.add_argument_group("cluster (started here, stopped at the end)")
    cluster.add_argument("--model", default="tiny", help=f"{MODELS} (default tiny)")
    cluster.add_argument("--coordinators", type=int, default=2, help="coordinators (default 2)")
    cluster.add_argument("--nodes", type=int, default=3, help="kvnodes (default 3)")
    cluster.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    cluster.add_argument("--replicas", type=int, default=2, help="kvnodes per sequence (default 2)")
    cluster.add_argument("--kv-dtype", choices=KV_DTYPES, default="float32",
                         help="KV dtype (default float32)")
    cluster.add_argument("--eviction", choices=NODE_POLICIES, default=None, help="the kvnodes' eviction policy "
                         "(default theirs, prefix-lru); a small --node-capacity makes them evict under the load")
    cluster.add_argument("--node-capacity", default="64MiB", help="page pool per kvnode (default 64MiB)")
    cluster.add_argument("--worker-kv-cache", default="64MiB", help="local KV pool per worker (default 64MiB)")
    cluster.add_argument("--blas-threads", type=int, default=None, help="BLAS threads per worker (default: cores / "
                         "workers, at least 1)")
    cluster.add_argument("--load", type=int, default=0, metavar="N", help="busy processes beside the cluster for the "
                         "whole run, each multiplying matrices on one core (default 0)")
    load = parser.add_argument_group("load")
    load.add_argument("--duration", type=float, default=60.0, help="seconds of load and faults (default 60)")
    load.add_argument("--concurrency", type=int, default=8, help="concurrent clients (default 8)")
    load.add_argument("--prompts", type=int, default=12, help="distinct prompts, each sent greedy and seeded "
                      "(default 12)")
    load.add_argument("--max-tokens", type=int, default=200, help="tokens per answer, end-of-text ignored "
                      "(default 200)")
    load.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    load.add_argument("--request-timeout", type=float, default=60.0, help="seconds one request may take, each "
                      "attempt (default 60)")
    faults = parser.add_argument_group("faults")
    faults.add_argument("--faults", default=",".join(KINDS), help=f"kinds, in turn: {', '.join(KINDS)} "
                        "(default all, in that order)")
    faults.add_argument("--fault-interval", type=float, default=8.0, help="seconds between faults; the first "
                        "after half of it (default 8)")
    faults.add_argument("--down-time", type=float, default=1.0, help="seconds a member stays down before its "
                        "restart (default 1)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    out.add_argument("--logs", metavar="DIR", default=None, help="daemon logs (default: a temp dir)")
    out.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def run(args: argparse.Namespace) -> int:
    try:
        kinds = _check(args)
    except ValueError as exc:
        print(f"kvcache bench chaos: error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so the cluster is stopped on the way out
    say = (lambda m: None) if args.json or args.no_progress else (lambda m: print(m, file=sys.stderr, flush=True))
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="kvcache-bench-chaos-")) / "logs"
    say(f"starting a local cluster ({args.coordinators} coordinators, {args.nodes} kvnodes, {args.workers} workers, "
        f"model {args.model}); logs in {logs}")
    cluster = LocalCluster()
    with busy_processes(args.load, _busy_bound(args)) as busy_pids:   # killed by pid on the way out
        if args.load:
            say(f"{args.load} busy processes beside the cluster: pids {', '.join(map(str, busy_pids))}")
        try:
            start_cluster(logs, args.nodes, args.workers, args.coordinators, args.replicas, args.model,
                          kv_dtype=args.kv_dtype, node_capacity=args.node_capacity,
                          worker_kv_cache=args.worker_kv_cache, blas_threads=args.blas_threads, cluster=cluster,
                          eviction=args.eviction)
            wait_healthy(cluster.coordinator_addresses, args.nodes, args.workers, timeout_s=120.0)
            result = _bench(args, kinds, cluster, logs, say)
        except (DaemonFailed, TimeoutError, OSError, ValueError) as exc:
            print(f"kvcache bench chaos: error: {exc} (logs: {logs})", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("kvcache bench chaos: interrupted; stopping the cluster", file=sys.stderr)
            return 130
        finally:
            cluster.stop()
    result["processes_left"] = [pid for pid in result["pids"] if _still_running(pid)] + busy_running(busy_pids)
    result["busy_pids"] = busy_pids
    if args.json:
        dump_json(result)
    else:
        report.print_report(result)
    return 0


def _bench(args, kinds: list[str], cluster: LocalCluster, logs: Path, say) -> dict:
    coordinators = cluster.coordinator_addresses
    requests = build_requests(args.prompts, args.seed, f"{uuid.uuid4().hex[:6]} ")
    stopping = threading.Event()
    watch_from = time.time()
    watcher = StatusWatcher(coordinators)
    injector = None
    watcher.start()
    try:
        say(f"reference: {len(requests)} requests on the undisturbed cluster")
        done = run_clients(coordinators, requests, args.concurrency, args.max_tokens, args.request_timeout, None,
                           stopping)
        reference = {o.request.label: o for o in done}
        say(f"load with faults for {args.duration:.0f}s: {', '.join(kinds)} every {args.fault_interval:.0f}s")
        start = time.time()
        until = time.monotonic() + args.duration
        injector = FaultInjector(cluster, kinds, args.fault_interval, args.down_time, until, say)
        injector.start()
        outcomes = run_clients(coordinators, requests, args.concurrency, args.max_tokens, args.request_timeout,
                               until, stopping)
    finally:
        stopping.set()
        if injector is not None:
            injector.stop()
        watcher.stop()
    coordinator_logs = [d.log_path for d in cluster.role("coordinator")]
    sightings = watcher.sightings + log_sightings(coordinator_logs, watch_from)
    wrong = wrongly_dead(sightings, [f.downtime() for f in injector.faults])
    load = report.count_outcomes(outcomes, reference)
    everything = load["by_kind"]["all"]
    return {
        "bench": "chaos",
        "machine": machine(),
        "versions": versions(),
        "options": {k: v for k, v in vars(args).items() if k != "run"},
        "cluster": {"coordinators": args.coordinators, "nodes": args.nodes, "workers": args.workers,
                    "model": args.model, "logs": str(logs)},
        "seeded_temperature": SEEDED_TEMPERATURE,
        "reference": report.reference_summary(reference, requests),
        "faults": report.fault_summary(injector.faults, start),
        "load": load,
        "resumed_by_coordinators": resumed_streams(coordinator_logs, start),
        "wrongly_dead": report.dead_summary(wrong, len(sightings), start),
        "status_polls": watcher.polls,
        "pids": injector.pids,
        "goal": {"failed": everything["failed"], "differing": everything["differing"],
                 "met": everything["failed"] == 0 and everything["differing"] == 0},
    }


def _check(args) -> list[str]:
    for name in ("coordinators", "nodes", "workers", "replicas", "concurrency", "prompts", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.replicas > args.nodes:
        raise ValueError(f"--replicas {args.replicas} exceeds --nodes {args.nodes}")
    if args.blas_threads is not None and args.blas_threads < 1:
        raise ValueError(f"--blas-threads must be at least 1, got {args.blas_threads}")
    for name in ("duration", "fault_interval", "request_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.down_time < 0:
        raise ValueError(f"--down-time must be >= 0, got {args.down_time}")
    if not 0 <= args.load <= 64:
        raise ValueError(f"--load must be 0 to 64 busy processes, got {args.load}")
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"--faults takes kinds among {', '.join(KINDS)}, got {args.faults!r}")
    from kvcache.model_pages import model_page_bytes
    from base.units import parse_size

    model_page_bytes(args.model, "float32")  # ValueError for an unknown model
    parse_size(args.node_capacity), parse_size(args.worker_kv_cache)
    return kinds


def _busy_bound(args) -> float:
    """Seconds after which a busy process stops by itself, should the bench not kill it: the
    cluster's start, the reference pass and the load, with room to spare."""
    return 600.0 + 3 * args.duration + 2 * args.request_timeout * args.prompts


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _still_running(pid: int) -> bool:
    """The pid still runs a kvcache daemon (not a process that reused the number)."""
    try:
        return b"kvcache.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
