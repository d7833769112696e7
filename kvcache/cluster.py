"""`kvcache cluster up|down|prometheus-config`: a local multi-process cluster on free loopback ports.

`up` starts coordinators, then kvnodes and workers registered with them, waits until
every coordinator sees every member alive, writes the cluster file (JSON: each member's
role, address, pid and log), and stays in the foreground until Ctrl-C (or --detach).
`down` reads the cluster file and stops every process in it. No process outlives either.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.client import Client, ClusterError
from kvcache import prometheus
from kvcache.cluster_file import ClusterFileError, read_cluster_file
from kvcache.launch import Daemon, DaemonFailed
from kvcache.model_pages import model_page_bytes
from kvnode.disk_tier import CHECK_AT_START, DISK_CHECKS
from kvnode.flusher import DEFAULT_FLUSH_INTERVAL_S, check_flush_interval
from protos import tokens
from protos.units import parse_size
from worker.model.named import DEFAULT_MODEL

DEFAULT_RUN_DIR = ".kvcache"
CLUSTER_FILE = "cluster.json"
MONITOR_TOKEN_FILE = "monitor.token"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    up = actions.add_parser("up", help="start a local cluster", description=__doc__)
    up.add_argument("--nodes", type=int, default=3, help="kvnodes (default 3)")
    up.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    up.add_argument("--coordinators", type=int, default=2, help="coordinators (default 2)")
    up.add_argument("--replicas", type=int, default=2, help="kvnodes per sequence (default 2)")
    up.add_argument("--model", default=DEFAULT_MODEL,
                    help=f"{DEFAULT_MODEL}, tiny, gpt2-small-shape, a .gguf file or a checkpoint folder (default {DEFAULT_MODEL})")
    up.add_argument("--kv-dtype", choices=["float32", "float16"], default="float32", help="KV dtype (default float32)")
    up.add_argument("--node-capacity", default="64MiB", help="page pool per kvnode (default 64MiB)")
    up.add_argument("--data-dir", default=None, metavar="DIR",
                    help="keep each kvnode's pages in DIR/node-N (its --data-dir), so a cluster started again on "
                         "DIR finds them (default: none, RAM only)")
    up.add_argument("--flush-interval", type=float, default=None, metavar="SECONDS",
                    help="with --data-dir: each kvnode's --flush-interval, seconds between writes of new pages to "
                         "disk, 0 before each put is answered "
                         f"(default: the kvnode's, {DEFAULT_FLUSH_INTERVAL_S:g})")
    up.add_argument("--disk-check", choices=DISK_CHECKS, default=None,
                    help="with --data-dir: each kvnode's --disk-check, when a page read from disk has its bytes "
                         "checked: start (each slot once a process) or always "
                         f"(default: the kvnode's, {CHECK_AT_START})")
    up.add_argument("--worker-kv-cache", default="64MiB", help="local KV pool per worker (default 64MiB)")
    up.add_argument("--blas-threads", type=int, default=None,
                    help="BLAS threads per worker (default: cores / workers, at least 1, so workers do not "
                         "fight over the cores)")
    up.add_argument("--max-prefill-tokens", type=int, default=None,
                    help="prompt tokens a worker computes per step, in chunks (default: the worker's, 128)")
    up.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help=f"cluster file and logs (default ./{DEFAULT_RUN_DIR})")
    up.add_argument("--detach", action="store_true", help="return once healthy; stop later with `kvcache cluster down`")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for a healthy cluster (default 120)")
    up.add_argument("--secure", action="store_true",
                    help="mutual TLS between every member (a development CA and certificates made into RUN_DIR/tls "
                         "by `kvcache certs`) and a client token (RUN_DIR/tokens, printed); `generate` and "
                         "`status` then need the printed options")
    up.add_argument("--gateway-port", type=int, default=0,
                    help="port of the OpenAI-compatible HTTP gateway in front of the coordinators (default 0: a "
                         "free one; its URL is printed and in the cluster file as `gateway`)")
    up.add_argument("--no-gateway", action="store_true", help="start no HTTP gateway")
    up.add_argument("--no-metrics", action="store_true",
                    help="no --metrics-port on the members (default: each serves Prometheus metrics on a free "
                         "port, recorded in the cluster file as `metrics`)")
    up.set_defaults(run=run_up)
    down = actions.add_parser("down", help="stop the cluster in the run directory")
    down.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help=f"where `up` wrote its cluster file (default ./{DEFAULT_RUN_DIR})")
    down.set_defaults(run=run_down)
    scrape = actions.add_parser("prometheus-config", help="print how Prometheus scrapes the cluster's metrics",
                                description=prometheus.__doc__)
    prometheus.add_arguments(scrape, DEFAULT_RUN_DIR)
    scrape.set_defaults(run=run_prometheus_config)


def run_up(args: argparse.Namespace) -> int:
    try:
        _check_counts(args)
        disk_tier_args(args.data_dir, args.flush_interval, args.disk_check)
        model_page_bytes(args.model, args.kv_dtype)
        parse_size(args.node_capacity), parse_size(args.worker_kv_cache)
    except ValueError as exc:
        print(f"kvcache cluster up: error: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir).resolve()
    cluster_file = run_dir / CLUSTER_FILE
    if cluster_file.exists():
        print(f"kvcache cluster up: error: {cluster_file} exists: a cluster may be running; "
              f"run `kvcache cluster down --run-dir {args.run_dir}` first", file=sys.stderr)
        return 2
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    tls_dir, tokens_file, token = _secure_files(run_dir) if args.secure else (None, None, None)
    client_options = {**client_tls(tls_dir), "token": token} if args.secure else {}
    scrape_secrets = _scrape_secrets(run_dir, tls_dir)

    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    cluster = LocalCluster()
    try:
        start_cluster(logs, args.nodes, args.workers, args.coordinators, args.replicas, args.model, args.kv_dtype,
                      args.node_capacity, args.worker_kv_cache, blas_threads=args.blas_threads,
                      max_prefill_tokens=args.max_prefill_tokens, cluster=cluster, metrics=not args.no_metrics,
                      data_dir=Path(args.data_dir).resolve() if args.data_dir else None,
                      flush_interval=args.flush_interval, disk_check=args.disk_check,
                      tls_dir=tls_dir, tokens_file=tokens_file,
                      gateway_port=None if args.no_gateway else args.gateway_port,
                      on_start=lambda c: _write_cluster_file(cluster_file, args, c.daemons, scrape_secrets))
        coordinators = cluster.coordinator_addresses
        wait_healthy(coordinators, args.nodes, args.workers, args.timeout, stopping, client_options)
    except (DaemonFailed, TimeoutError, InterruptedError, ValueError) as exc:
        print(f"kvcache cluster up: error: {exc}", file=sys.stderr)
        cluster.stop()
        cluster_file.unlink(missing_ok=True)
        return 1
    print(f"cluster up: {args.coordinators} coordinators, {args.nodes} kvnodes, {args.workers} workers, model {args.model}")
    print(f"coordinators: {','.join(coordinators)}")
    if cluster.gateway_url:
        print(f"gateway: {cluster.gateway_url} (OpenAI API at {cluster.gateway_url}/v1)")
    print(f"logs: {logs}")
    print(f"cluster file: {cluster_file}")
    if args.secure:
        tls = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in client_tls(tls_dir).items())
        print(f"mutual TLS: certificates in {tls_dir}; tokens file {tokens_file}")
        print(f"token: {token}")
        if not args.no_metrics:
            print(f"metrics: HTTPS for the kvcache-monitor certificate ({tls_dir}/monitor.pem), the gateway's with "
                  f"the monitor token; `kvcache cluster prometheus-config --scrape-config` prints a Prometheus config")
        print(f"try: KVCACHE_TOKEN={token} kvcache generate --coordinators {','.join(coordinators)} {tls} \"Hello\"",
              flush=True)
    else:
        print(f"try: kvcache generate --coordinators {','.join(coordinators)} \"Hello\"", flush=True)
    if args.detach:
        return 0
    print("Ctrl-C stops the cluster.", flush=True)
    reported: set[int] = set()
    while not stopping.wait(1.0):
        for daemon in cluster.daemons:
            if not daemon.alive() and daemon.pid not in reported:
                reported.add(daemon.pid)
                print(f"{daemon.role} {daemon.address} exited (code {daemon.process.returncode}); see {daemon.log_path}",
                      flush=True)
    print("stopping the cluster ...", flush=True)
    cluster.stop()
    cluster_file.unlink(missing_ok=True)
    print("cluster stopped", flush=True)
    return 0


def _secure_files(run_dir: Path) -> tuple[Path, Path, str]:
    """Certificates in RUN_DIR/tls and a tokens file of two tenants: `default`, with a new token
    for clients, and `monitor`, whose token (alone in RUN_DIR/monitor.token) a Prometheus sends
    to the gateway's /metrics (kvcache/prometheus.py)."""
    from kvcache.certs import make_certs

    tls_dir = run_dir / "tls"
    make_certs(tls_dir, force=True)
    token = tokens.new_token()
    monitor_token = tokens.new_token()
    tokens_file = run_dir / "tokens"
    _write_private(tokens_file, f"default {token}\nmonitor {monitor_token}\n")
    _write_private(run_dir / MONITOR_TOKEN_FILE, f"{monitor_token}\n")
    return tls_dir, tokens_file, token


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def _scrape_secrets(run_dir: Path, tls_dir: Path | None) -> dict | None:
    """What a Prometheus needs to scrape a secure cluster, for the cluster file; None for plaintext."""
    if tls_dir is None:
        return None
    return {"ca_file": str(tls_dir / "ca.pem"), "cert_file": str(tls_dir / "monitor.pem"),
            "key_file": str(tls_dir / "monitor.key"), "token_file": str(run_dir / MONITOR_TOKEN_FILE)}


def run_prometheus_config(args: argparse.Namespace) -> int:
    return prometheus.run(args, Path(args.run_dir).resolve() / CLUSTER_FILE)


def run_down(args: argparse.Namespace) -> int:
    cluster_file = Path(args.run_dir).resolve() / CLUSTER_FILE
    try:
        cluster = read_cluster_file(cluster_file, "nothing to stop")
    except ClusterFileError as exc:
        print(f"kvcache cluster down: {exc}", file=sys.stderr)
        return exc.exit_code
    members = cluster.get("members", [])
    for member in _stop_order(members):
        _terminate(member["pid"])
    deadline = time.monotonic() + 20.0
    while any(_is_ours(m["pid"]) for m in members) and time.monotonic() < deadline:
        time.sleep(0.1)
    for member in members:
        if _is_ours(member["pid"]):
            os.kill(member["pid"], signal.SIGKILL)
    cluster_file.unlink(missing_ok=True)
    print(f"stopped {len(members)} processes")
    return 0


# ---- internals -----------------------------------------------------------------------


def _check_counts(args: argparse.Namespace) -> None:
    for name in ("nodes", "workers", "coordinators", "replicas"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.blas_threads is not None and args.blas_threads < 1:
        raise ValueError(f"--blas-threads must be at least 1, got {args.blas_threads}")
    if args.max_prefill_tokens is not None and args.max_prefill_tokens < 1:
        raise ValueError(f"--max-prefill-tokens must be at least 1, got {args.max_prefill_tokens}")
    if not 0 <= args.gateway_port <= 65535:
        raise ValueError(f"--gateway-port must be between 0 and 65535, got {args.gateway_port}")
    if args.replicas > args.nodes:
        raise ValueError(f"--replicas {args.replicas} exceeds --nodes {args.nodes}: each replica needs its own kvnode")


def disk_tier_args(data_dir: Path | str | None, flush_interval: float | None, disk_check: str | None) -> list[str]:
    """The disk tier's options every kvnode gets, those not given left to the kvnode's defaults.
    ValueError for one given without data_dir: a kvnode without a disk tier would ignore it."""
    given = [name for name, value in (("--flush-interval", flush_interval), ("--disk-check", disk_check))
             if value is not None]
    if given and data_dir is None:
        raise ValueError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --data-dir: "
                         "without a data folder the kvnodes have no disk tier")
    if flush_interval is not None:
        check_flush_interval(flush_interval)
    if disk_check is not None and disk_check not in DISK_CHECKS:
        raise ValueError(f"--disk-check must be one of {', '.join(DISK_CHECKS)}, got {disk_check!r}")
    options = ["--flush-interval", repr(flush_interval)] if flush_interval is not None else []
    return options + (["--disk-check", disk_check] if disk_check is not None else [])


@dataclass
class LocalCluster:
    """Daemons started by start_cluster, in start order; stop() ends them all by pid."""

    daemons: list[Daemon] = field(default_factory=list)

    def role(self, role: str) -> list[Daemon]:
        return [d for d in self.daemons if d.role == role]

    @property
    def coordinator_addresses(self) -> list[str]:
        return [d.address for d in self.role("coordinator")]

    @property
    def gateway_url(self) -> str | None:
        """http://HOST:PORT of the HTTP gateway, when one was started."""
        return next((d.address for d in self.role("gateway")), None)

    def restart(self, daemon: Daemon, port: int | None = None, timeout_s: float = 30.0) -> Daemon:
        """Start a stopped member again with its arguments, on `port` (default: the port it had), same log."""
        if daemon.alive():
            raise ValueError(f"{daemon.role} {daemon.address} (pid {daemon.pid}) still runs: stop it first")
        args = list(daemon.args)
        args[args.index("--port") + 1] = str(port if port is not None else daemon.address.rsplit(":", 1)[1])
        again = Daemon(daemon.role, args, log_path=daemon.log_path, timeout_s=timeout_s)
        self.daemons[self.daemons.index(daemon)] = again
        return again

    def stop(self) -> None:
        _stop_all(self.daemons)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_cluster(logs: Path, nodes: int = 3, workers: int = 2, coordinators: int = 2, replicas: int = 2,
                  model: str = "tiny", kv_dtype: str = "float32", node_capacity: str = "64MiB",
                  worker_kv_cache: str = "64MiB", blas_threads: int | None = None, on_start=None,
                  cluster: LocalCluster | None = None, step_logs: bool = False,
                  max_prefill_tokens: int | None = None, data_dir: Path | None = None,
                  flush_interval: float | None = None, disk_check: str | None = None,
                  metrics: bool = False, tls_dir: Path | None = None,
                  tokens_file: Path | None = None, gateway_port: int | None = None,
                  otlp_endpoint: str | None = None, trace_sample_ratio: float | None = None) -> LocalCluster:
    """Start coordinators, then kvnodes and workers registered with them (not yet waiting for health).

    Each worker gets `blas_threads` BLAS threads (default: cores / workers, at least 1) and
    `max_prefill_tokens` (default: the worker's own); with `step_logs`, each writes one JSON line
    per engine step to `<logs>/<worker>.steps.jsonl`. With `data_dir`, kvnode i keeps its pages in
    `<data_dir>/node-i` (kvcache node --data-dir; `flush_interval` and `disk_check` are its
    --flush-interval and --disk-check when given); with `metrics`, every member serves Prometheus
    metrics on a free port (`Daemon.metrics_url`). With `tls_dir` (made by `kvcache certs`), every
    member serves and calls over mutual TLS with its role's certificate (tls_args); with
    `tokens_file`, coordinators and workers want a client token from it (protos/tokens.py). With
    `gateway_port` (0: a free one), an HTTP gateway (`kvcache gateway`) serves the OpenAI API in
    front of the coordinators, with /metrics when `metrics`. With `otlp_endpoint`, every member
    (and the gateway) exports trace spans there (--otlp-endpoint; needs the `otel` extra), of
    `trace_sample_ratio` of the requests when given (--trace-sample-ratio).

    `on_start(cluster)` runs after each start, so a caller can record pids as they appear; on
    failure, or an interrupt (Ctrl-C, a SIGTERM handler's SystemExit), whatever started is
    stopped before the exception propagates.
    """
    cluster = cluster or LocalCluster()
    page_bytes = model_page_bytes(model, kv_dtype)
    disk_args = disk_tier_args(data_dir, flush_interval, disk_check)
    logs.mkdir(parents=True, exist_ok=True)

    def launch(role: str, name: str, daemon_args: list[str]) -> Daemon:
        extra = ["--metrics-port", "0"] if metrics else []
        if otlp_endpoint is not None:
            extra += ["--otlp-endpoint", otlp_endpoint]
            if trace_sample_ratio is not None:
                extra += ["--trace-sample-ratio", repr(trace_sample_ratio)]
        if tls_dir is not None:
            extra += tls_args(tls_dir, role)
        if tokens_file is not None and role in ("coordinator", "worker"):
            extra += ["--tokens-file", str(tokens_file)]
        daemon = Daemon(role, ["--port", "0", *extra, *daemon_args], log_path=logs / f"{name}.log")
        cluster.daemons.append(daemon)
        if on_start:
            on_start(cluster)
        return daemon

    try:
        for i in range(coordinators):
            launch("coordinator", f"coordinator-{i}", ["--replicas", str(replicas), "--coordinator-id", f"coordinator-{i}"])
        joined = ",".join(cluster.coordinator_addresses)
        for i in range(nodes):
            node_args = ["--coordinators", joined, "--node-id", f"node-{i}",
                         "--page-bytes", str(page_bytes), "--capacity", node_capacity]
            if data_dir is not None:
                node_args += ["--data-dir", str(data_dir / f"node-{i}"), *disk_args]
            launch("node", f"node-{i}", node_args)
        threads = blas_threads or default_blas_threads(workers)
        for i in range(workers):
            add_worker(cluster, logs, f"worker-{i}", model, kv_dtype, worker_kv_cache, launch, blas_threads=threads,
                       step_log=step_logs, max_prefill_tokens=max_prefill_tokens)
        if gateway_port is not None:
            gateway = Daemon("gateway", ["--port", str(gateway_port), "--coordinators", joined,
                                         *(["--metrics"] if metrics else []),
                                         *(["--otlp-endpoint", otlp_endpoint] if otlp_endpoint else []),
                                         *(["--trace-sample-ratio", repr(trace_sample_ratio)]
                                           if otlp_endpoint and trace_sample_ratio is not None else []),
                                         *(tls_args(tls_dir, "client") if tls_dir is not None else [])],
                             log_path=logs / "gateway.log")
            cluster.daemons.append(gateway)
            if on_start:
                on_start(cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def add_worker(cluster: LocalCluster, logs: Path, name: str, model: str = "tiny", kv_dtype: str = "float32",
               kv_cache: str = "64MiB", launch=None, blas_threads: int | None = None,
               step_log: bool = False, max_prefill_tokens: int | None = None) -> Daemon:
    """Start one more worker registered with the cluster's coordinators."""
    args = ["--coordinators", ",".join(cluster.coordinator_addresses), "--worker-id", name, "--model", model,
            "--kv-dtype", kv_dtype, "--kv-cache", kv_cache]
    if blas_threads is not None:
        args += ["--blas-threads", str(blas_threads)]
    if max_prefill_tokens is not None:
        args += ["--max-prefill-tokens", str(max_prefill_tokens)]
    if step_log:
        args += ["--step-log", str(logs / f"{name}.steps.jsonl")]
    if launch:
        return launch("worker", name, args)
    daemon = Daemon("worker", ["--port", "0", *args], log_path=logs / f"{name}.log")
    cluster.daemons.append(daemon)
    return daemon


def tls_args(tls_dir: Path, role: str) -> list[str]:
    """--tls-cert, --tls-key and --tls-ca of `role` from a folder made by `kvcache certs`."""
    return ["--tls-cert", str(tls_dir / f"{role}.pem"), "--tls-key", str(tls_dir / f"{role}.key"),
            "--tls-ca", str(tls_dir / "ca.pem")]


def client_tls(tls_dir: Path | None) -> dict:
    """Client's keywords for a cluster started with `tls_dir` (its client certificate); {} for plaintext."""
    if tls_dir is None:
        return {}
    return {"tls_ca": str(tls_dir / "ca.pem"), "tls_cert": str(tls_dir / "client.pem"),
            "tls_key": str(tls_dir / "client.key")}


def default_blas_threads(workers: int) -> int:
    """BLAS threads per worker when `workers` share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def _write_cluster_file(path: Path, args, started: list[Daemon], secure: dict | None = None) -> None:
    gateway = next((d.address for d in started if d.role == "gateway"), None)
    cluster = {
        "model": args.model,
        **({"gateway": gateway} if gateway else {}),
        **({"secure": secure} if secure else {}),
        "replicas": args.replicas,
        "members": [
            {"role": d.role, "address": d.address, "pid": d.pid, "log": str(d.log_path),
             **({"metrics": d.metrics_url} if d.metrics_url else {})} for d in started
        ],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cluster, indent=2))
    tmp.replace(path)


def wait_healthy(coordinators: list[str], nodes: int, workers: int, timeout_s: float = 60.0,
                 stopping: threading.Event | None = None, client_options: dict | None = None) -> None:
    """Until every coordinator sees `nodes` kvnodes and `workers` workers alive (TimeoutError after timeout_s);
    `client_options`: Client's keywords (TLS, token) for a secure cluster."""
    deadline = time.monotonic() + timeout_s
    pending = list(coordinators)
    seen = "nothing yet"
    while pending:
        if stopping is not None and stopping.is_set():
            raise InterruptedError("interrupted while starting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"cluster not healthy after {timeout_s:.0f}s: coordinator {pending[0]} sees {seen}")
        address = pending[0]
        try:
            with Client([address], **(client_options or {})) as client:
                status = client.status(timeout=2.0)
            alive = [m.role for m in status.members if m.alive]
            seen = f"{alive.count('node')}/{nodes} kvnodes, {alive.count('worker')}/{workers} workers"
            if alive.count("node") >= nodes and alive.count("worker") >= workers:
                pending.pop(0)
                continue
        except ClusterError:
            pass
        time.sleep(0.2)


_STOP_RANK = {"gateway": 0, "worker": 1, "node": 2, "coordinator": 3}


def _stop_order(members: list[dict]) -> list[dict]:
    """The gateway first (it takes no new request), workers (they drain), then kvnodes, then coordinators."""
    return sorted(members, key=lambda m: _STOP_RANK.get(m["role"], 4))


def _stop_all(started: list[Daemon]) -> None:
    for daemon in sorted(started, key=lambda d: _STOP_RANK.get(d.role, 4)):
        if daemon.alive():
            os.kill(daemon.pid, signal.SIGTERM)
    for daemon in started:
        daemon.stop(timeout_s=20.0)


def _terminate(pid: int) -> None:
    if _is_ours(pid):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _is_ours(pid: int) -> bool:
    """The pid still runs a kvcache daemon (not a process that reused the number)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"kvcache.cli" in cmdline
