"""`kvcache cluster up|down|prometheus-config`: a local multi-process cluster on free loopback ports.

`up` starts coordinators, then kvnodes and workers registered with them, waits until
every coordinator sees every member alive, writes the cluster file (JSON: each member's
role, address, pid and log), and stays in the foreground until Ctrl-C (or --detach).
With --vllm-model it starts no workers: its kvnodes keep a vLLM engine's blocks (cluster_vllm.py).
`down` reads the cluster file and stops every process in it. No process outlives either.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

from base.pool_sizes import MAX_NODE_POOL_BYTES, MAX_WORKER_POOL_BYTES, MIN_POOL_BYTES, describe
from kvcache import cluster_sizes, cluster_vllm, prometheus
from kvcache.cluster import LocalCluster, client_tls, disk_tier_args, start_cluster, stop_members, wait_healthy
from kvcache.cluster_file import CLIENT_TOKEN_FILE, CLUSTER_FILE, DEFAULT_RUN_DIR, ClusterFileError, read_cluster_file
from kvcache.launch import Daemon, DaemonFailed
from kvcache.model_pages import VllmBlockPages
from kvnode.disk.tier import CHECK_AT_START, DISK_CHECKS
from kvnode.store.flusher import DEFAULT_FLUSH_INTERVAL_S
from base import tokens
from base.pages import KV_DTYPES
from worker.model.named import DEFAULT_MODEL

MONITOR_TOKEN_FILE = "monitor.token"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    up = actions.add_parser("up", help="start a local cluster", description=__doc__)
    up.add_argument("--nodes", type=int, default=3, help="kvnodes (default 3)")
    up.add_argument("--workers", type=int, default=None, help="workers (default 2)")
    up.add_argument("--coordinators", type=int, default=2, help="coordinators (default 2)")
    up.add_argument("--replicas", type=int, default=2, help="kvnodes per sequence (default 2)")
    up.add_argument("--model", default=None,
                    help=f"{DEFAULT_MODEL}, tiny, gpt2-small-shape, a .gguf file or a checkpoint folder (default {DEFAULT_MODEL})")
    up.add_argument("--kv-dtype", choices=KV_DTYPES, default=None, help="KV dtype (default float32)")
    up.add_argument("--node-capacity", default=None,
                    help="page pool per kvnode, allocated at start (default: enough that one kvnode leases a whole "
                         "prompt of the model's full context at once, half its pool: 720MiB for smollm2-135m in "
                         f"float32, at most {describe(MAX_NODE_POOL_BYTES)}; "
                         f"{cluster_vllm.VLLM_NODE_CAPACITY} with --vllm-model: vLLM's blocks are large, one of "
                         "128 tokens of a 30-layer model in bfloat16 is 30 pages of 96KiB, ~3MB, so 64MiB would "
                         "hold ~2.8k tokens of prompts a kvnode and 1GiB holds ~46k)")
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
    up.add_argument("--worker-kv-cache", default=None,
                    help="local KV pool per worker, written at start (default: one sequence of the model's full "
                         "context, 360MiB for smollm2-135m in float32, at least "
                         f"{describe(MIN_POOL_BYTES)} and at most {describe(MAX_WORKER_POOL_BYTES)}); `cluster up` "
                         "says both pools' sizes in one line before it starts")
    up.add_argument("--blas-threads", type=int, default=None,
                    help="BLAS threads per worker (default: cores / workers, at least 1, so workers do not "
                         "fight over the cores)")
    up.add_argument("--max-prefill-tokens", type=int, default=None,
                    help="prompt tokens a worker computes per step beside decodes, in chunks (default: the "
                         "worker's, 128)")
    up.add_argument("--alone-prefill-tokens", type=int, default=None,
                    help="prompt tokens a worker computes in a step with no decode, in chunks (default: the "
                         "worker's, 512)")
    up.add_argument("--run-dir", default=DEFAULT_RUN_DIR, help=f"cluster file and logs (default ./{DEFAULT_RUN_DIR})")
    up.add_argument("--detach", action="store_true", help="return once healthy; stop later with `kvcache cluster down`")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for a healthy cluster (default 120)")
    up.add_argument("--secure", action="store_true",
                    help="mutual TLS between every member (a development CA and certificates made into RUN_DIR/tls "
                         "by `kvcache certs`), a client token (printed, and alone in RUN_DIR/client.token) and the "
                         "gateway on HTTPS; a client needs only the CA (RUN_DIR/tls/ca.pem) and the token: "
                         "`generate` and `status` find both through the cluster file, and it prints the options to "
                         "give from elsewhere")
    up.add_argument("--gateway-port", type=int, default=None,
                    help="port of the OpenAI-compatible HTTP gateway in front of the coordinators (default 0: a "
                         "free one; its URL is printed and in the cluster file as `gateway`)")
    up.add_argument("--no-gateway", action="store_true", help="start no HTTP gateway")
    up.add_argument("--no-metrics", action="store_true",
                    help="no --metrics-port on the members (default: each serves Prometheus metrics on a free "
                         "port, recorded in the cluster file as `metrics`)")
    cluster_vllm.add_arguments(up)
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
        vllm = _check_options(args)
    except ValueError as exc:
        print(f"kvcache cluster up: error: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir).resolve()
    cluster_file = run_dir / CLUSTER_FILE
    if cluster_file.exists():
        print(f"kvcache cluster up: error: {cluster_file} exists: a cluster may be running; "
              f"run `kvcache cluster down --run-dir {args.run_dir}` first", file=sys.stderr)
        return 2
    if vllm is None:
        print(args.sizes.line(), flush=True)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    kv_transfer_file = run_dir / cluster_vllm.KV_TRANSFER_FILE
    kv_transfer_file.unlink(missing_ok=True)  # one left by a cluster that is gone names its addresses

    tls_dir, tokens_file, token = _secure_files(run_dir, vllm is not None) if args.secure else (None, None, None)
    client_options = {**client_tls(tls_dir), "token": token} if args.secure else {}
    scrape_secrets = _scrape_secrets(run_dir, tls_dir)
    vllm_entry = cluster_vllm.cluster_file_entry(vllm, run_dir) if vllm else None

    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    cluster = LocalCluster()
    try:
        start_cluster(logs, args.nodes, args.workers, args.coordinators, args.replicas, args.model, args.kv_dtype,
                      args.node_capacity, args.worker_kv_cache, blas_threads=args.blas_threads,
                      max_prefill_tokens=args.max_prefill_tokens, alone_prefill_tokens=args.alone_prefill_tokens,
                      cluster=cluster, metrics=not args.no_metrics,
                      data_dir=Path(args.data_dir).resolve() if args.data_dir else None,
                      flush_interval=args.flush_interval, disk_check=args.disk_check,
                      tls_dir=tls_dir, tokens_file=tokens_file,
                      gateway_port=None if args.no_gateway else args.gateway_port,
                      page_bytes=vllm.page_bytes if vllm else None, max_keys=cluster_vllm.max_keys(vllm),
                      on_start=lambda c: _write_cluster_file(cluster_file, args, c.daemons, scrape_secrets,
                                                             vllm_entry))
        coordinators = cluster.coordinator_addresses
        wait_healthy(coordinators, args.nodes, args.workers, args.timeout, stopping, client_options)
    except (DaemonFailed, TimeoutError, InterruptedError, ValueError) as exc:
        print(f"kvcache cluster up: error: {exc}", file=sys.stderr)
        cluster.stop()
        cluster_file.unlink(missing_ok=True)
        return 1
    _print_started(args, cluster, logs, cluster_file, tls_dir, tokens_file, token)
    if vllm:
        config = cluster_vllm.kv_transfer_config(coordinators, run_dir, tls_dir)
        cluster_vllm.write_kv_transfer_config(kv_transfer_file, config)
        cluster_vllm.print_usage(vllm, args.model, config, kv_transfer_file)
    if args.detach:
        return 0
    _watch(cluster, stopping)
    print("stopping the cluster ...", flush=True)
    cluster.stop()
    cluster_file.unlink(missing_ok=True)
    kv_transfer_file.unlink(missing_ok=True)
    print("cluster stopped", flush=True)
    return 0


def _check_options(args: argparse.Namespace) -> VllmBlockPages | None:
    """Every option checked before anything starts (ValueError); the vLLM block's pages for a
    --vllm-model cluster, else None."""
    vllm = cluster_vllm.settle_options(args)
    _check_counts(args)
    disk_tier_args(args.data_dir, args.flush_interval, args.disk_check)
    if vllm is None:
        # The pools not given are sized to the model (kvcache/cluster_sizes.py), and said at start.
        args.sizes = cluster_sizes.settle(args.model, args.kv_dtype, args.worker_kv_cache, args.node_capacity,
                                          args.workers, args.nodes)
        args.worker_kv_cache = args.worker_kv_cache or args.sizes.worker.size()
        args.node_capacity = args.node_capacity or args.sizes.node.size()
    return vllm


def _print_started(args, cluster: LocalCluster, logs: Path, cluster_file: Path, tls_dir: Path | None,
                   tokens_file: Path | None, token: str | None) -> None:
    coordinators = ",".join(cluster.coordinator_addresses)
    members = "kvnodes for vLLM (no workers)" if args.vllm_model else f"kvnodes, {args.workers} workers"
    print(f"cluster up: {args.coordinators} coordinators, {args.nodes} {members}, model {args.model}")
    print(f"coordinators: {coordinators}")
    if cluster.gateway_url:
        https = (f"; HTTPS only, its certificate checked against {tls_dir}/ca.pem, the token below its API key"
                 if tls_dir is not None else "")
        print(f"gateway: {cluster.gateway_url} (OpenAI API at {cluster.gateway_url}/v1{https})")
    print(f"logs: {logs}")
    print(f"cluster file: {cluster_file}")
    # `generate` and `status` find the cluster (and a secure one's certificates and token) by its file.
    here = cluster_file.parent == (Path.cwd() / DEFAULT_RUN_DIR).resolve()
    where = "" if here else f" --run-dir {shlex.quote(args.run_dir)}"
    label, command = ("status", f"kvcache status{where}") if args.vllm_model else \
        ("try", f'kvcache generate{where} "Hello"')
    if args.secure:
        client_token = cluster_file.parent / CLIENT_TOKEN_FILE
        tls = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in client_tls(tls_dir).items())
        print(f"TLS: certificates in {tls_dir}, each member presenting its own; a client needs only {tls_dir}/ca.pem "
              f"and a token. Tokens file {tokens_file} (the daemons' --tokens-file; a client's --token-file too)")
        print(f"token: {token} (alone in {client_token}, for a client's --token-file)")
        if not args.no_metrics:
            gateway = ", the gateway's with the monitor token" if cluster.gateway_url else ""
            print(f"metrics: HTTPS for the kvcache-monitor certificate ({tls_dir}/monitor.pem){gateway}; "
                  f"`kvcache cluster prometheus-config --scrape-config` prints a Prometheus config")
        print(f"client options elsewhere: --coordinators {coordinators} {tls} --token-file {client_token}")
    print(f"{label}: {command}", flush=True)


def _watch(cluster: LocalCluster, stopping: threading.Event) -> None:
    """Until Ctrl-C or SIGTERM, say once of each member that it exited."""
    print("Ctrl-C stops the cluster.", flush=True)
    reported: set[int] = set()
    while not stopping.wait(1.0):
        for daemon in cluster.daemons:
            if not daemon.alive() and daemon.pid not in reported:
                reported.add(daemon.pid)
                print(f"{daemon.role} {daemon.address} exited (code {daemon.process.returncode}); see {daemon.log_path}",
                      flush=True)


def _secure_files(run_dir: Path, vllm: bool = False) -> tuple[Path, Path, str]:
    """Certificates in RUN_DIR/tls and a tokens file of two tenants: `default`, with a new token
    for clients (alone in RUN_DIR/client.token, a client's --token-file), and `monitor`, whose
    token (alone in RUN_DIR/monitor.token) a Prometheus sends to the gateway's /metrics
    (kvcache/prometheus.py). With `vllm`, a third, `vllm`, whose token (alone in
    RUN_DIR/vllm.token) and worker certificate (tls/vllm-connector.pem) the vLLM connector
    presents: kvnodes take pages only from a worker's certificate."""
    from kvcache.certs import make_certs

    tls_dir = run_dir / "tls"
    make_certs(tls_dir, force=True, extra={cluster_vllm.CONNECTOR_CERT: "worker"} if vllm else None)
    token = tokens.new_token()
    monitor_token = tokens.new_token()
    tenants = f"default {token}\nmonitor {monitor_token}\n"
    _write_private(run_dir / MONITOR_TOKEN_FILE, f"{monitor_token}\n")
    if vllm:
        connector_token = tokens.new_token()
        tenants += f"{cluster_vllm.TENANT} {connector_token}\n"
        _write_private(run_dir / cluster_vllm.TOKEN_FILE, f"{connector_token}\n")
    tokens_file = run_dir / "tokens"
    _write_private(tokens_file, tenants)
    _write_private(run_dir / CLIENT_TOKEN_FILE, f"{token}\n")  # a client's --token-file: the token alone
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
    run_dir = Path(args.run_dir).resolve()
    cluster_file = run_dir / CLUSTER_FILE
    try:
        cluster = read_cluster_file(cluster_file, "nothing to stop")
    except ClusterFileError as exc:
        print(f"kvcache cluster down: {exc}", file=sys.stderr)
        return exc.exit_code
    members = cluster.get("members", [])
    stop_members(members)
    cluster_file.unlink(missing_ok=True)
    (run_dir / cluster_vllm.KV_TRANSFER_FILE).unlink(missing_ok=True)  # its addresses are gone
    print(f"stopped {len(members)} processes")
    return 0


def _check_counts(args: argparse.Namespace) -> None:
    for name in ("nodes", "coordinators", "replicas") + (() if args.vllm_model else ("workers",)):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.blas_threads is not None and args.blas_threads < 1:
        raise ValueError(f"--blas-threads must be at least 1, got {args.blas_threads}")
    for name in ("max_prefill_tokens", "alone_prefill_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.gateway_port <= 65535:
        raise ValueError(f"--gateway-port must be between 0 and 65535, got {args.gateway_port}")
    if args.replicas > args.nodes:
        raise ValueError(f"--replicas {args.replicas} exceeds --nodes {args.nodes}: each replica needs its own kvnode")


def _write_cluster_file(path: Path, args, started: list[Daemon], secure: dict | None = None,
                        vllm: dict | None = None) -> None:
    gateway = next((d.address for d in started if d.role == "gateway"), None)
    cluster = {
        "model": args.model,
        **({"vllm": vllm} if vllm else {}),
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
