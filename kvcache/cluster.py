"""A local cluster's processes: coordinators, then kvnodes and workers registered with them (and
an HTTP gateway), each a daemon on a free loopback port; waiting until every coordinator sees them
alive; stopping them, gateway first. `kvcache cluster` (cluster_cli.py), the demo, the benches and
the tests start their clusters here.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.client import Client, ClusterError
from kvcache.launch import Daemon
from kvcache.model_pages import model_page_bytes
from kvnode.disk.tier import DISK_CHECKS
from kvnode.store.flusher import check_flush_interval


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
        """http://HOST:PORT of the HTTP gateway (https:// with `tls_dir`), when one was started."""
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
                  max_prefill_tokens: int | None = None, alone_prefill_tokens: int | None = None,
                  data_dir: Path | None = None,
                  flush_interval: float | None = None, disk_check: str | None = None,
                  metrics: bool = False, tls_dir: Path | None = None,
                  tokens_file: Path | None = None, gateway_port: int | None = None,
                  otlp_endpoint: str | None = None, trace_sample_ratio: float | None = None,
                  eviction: str | None = None, page_bytes: int | None = None,
                  max_keys: int | None = None) -> LocalCluster:
    """Start coordinators, then kvnodes and workers registered with them (not yet waiting for health).

    Each worker gets `blas_threads` BLAS threads (default: cores / workers, at least 1),
    `max_prefill_tokens` and `alone_prefill_tokens` (default: the worker's own); with `step_logs`,
    each writes one JSON line per engine step to `<logs>/<worker>.steps.jsonl`. With `data_dir`,
    kvnode i keeps its pages in `<data_dir>/node-i` (kvcache node --data-dir; `flush_interval` and
    `disk_check` are its --flush-interval and --disk-check when given); with `metrics`, every member serves Prometheus
    metrics on a free port (`Daemon.metrics_url`). With `tls_dir` (made by `kvcache certs`), every
    member serves and calls over mutual TLS with its role's certificate (tls_args); with
    `tokens_file`, coordinators and workers want a client token from it (base/tokens.py). With
    `gateway_port` (0: a free one), an HTTP gateway (`kvcache gateway`) serves the OpenAI API in
    front of the coordinators, with /metrics when `metrics`, and loads `model`'s tokenizer for its
    tokenizer routes (--tokenizer); with `tls_dir` it serves HTTPS with the gateway certificate. With `otlp_endpoint`, every member (and the gateway) exports
    trace spans there (--otlp-endpoint; needs the `otel` extra), of
    `trace_sample_ratio` of the requests when given (--trace-sample-ratio). `eviction`: the
    kvnodes' --eviction policy (default theirs). `page_bytes`: the kvnodes' page size when another
    engine than the workers' model fills them (default: a page of `model` in `kv_dtype`; a cluster
    for vLLM has no workers and vLLM's block size, kvcache/model_pages.py); `max_keys`: their
    --max-keys when given (a vLLM block is one page a layer, all asked for at once).

    The coordinators start together, then the rest together, each group waited for once
    started. `on_start(cluster)` runs after each start, so a caller can record pids as they
    appear (a daemon's address is None until its group serves), and once more as each group
    serves; on failure, or an interrupt (Ctrl-C, a SIGTERM handler's SystemExit), whatever
    started is stopped before the exception propagates.
    """
    cluster = cluster or LocalCluster()
    page_bytes = page_bytes or model_page_bytes(model, kv_dtype)
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
        return spawned(Daemon(role, ["--port", "0", *extra, *daemon_args], log_path=logs / f"{name}.log", wait=False))

    def spawned(daemon: Daemon) -> Daemon:
        cluster.daemons.append(daemon)
        if on_start:
            on_start(cluster)
        return daemon

    def serving() -> None:
        """Wait for every daemon started so far: they load at once, on every core."""
        for daemon in cluster.daemons:
            daemon.started()
        if on_start:
            on_start(cluster)  # now with their addresses

    try:
        for i in range(coordinators):
            launch("coordinator", f"coordinator-{i}", ["--replicas", str(replicas), "--coordinator-id", f"coordinator-{i}"])
        serving()
        joined = ",".join(cluster.coordinator_addresses)
        for i in range(nodes):
            node_args = ["--coordinators", joined, "--node-id", f"node-{i}",
                         "--page-bytes", str(page_bytes), "--capacity", node_capacity]
            if data_dir is not None:
                node_args += ["--data-dir", str(data_dir / f"node-{i}"), *disk_args]
            if eviction is not None:
                node_args += ["--eviction", eviction]
            if max_keys is not None:
                node_args += ["--max-keys", str(max_keys)]
            launch("node", f"node-{i}", node_args)
        threads = blas_threads or default_blas_threads(workers)
        for i in range(workers):
            add_worker(cluster, logs, f"worker-{i}", model, kv_dtype, worker_kv_cache, launch, blas_threads=threads,
                       step_log=step_logs, max_prefill_tokens=max_prefill_tokens,
                       alone_prefill_tokens=alone_prefill_tokens)
        if gateway_port is not None:
            spawned(Daemon("gateway", ["--port", str(gateway_port), "--coordinators", joined, "--tokenizer", model,
                                       *(["--metrics"] if metrics else []),
                                       *(["--otlp-endpoint", otlp_endpoint] if otlp_endpoint else []),
                                       *(["--trace-sample-ratio", repr(trace_sample_ratio)]
                                         if otlp_endpoint and trace_sample_ratio is not None else []),
                                       *(tls_args(tls_dir, "gateway") if tls_dir is not None else [])],
                           log_path=logs / "gateway.log", wait=False))
        serving()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def add_worker(cluster: LocalCluster, logs: Path, name: str, model: str = "tiny", kv_dtype: str = "float32",
               kv_cache: str = "64MiB", launch=None, blas_threads: int | None = None,
               step_log: bool = False, max_prefill_tokens: int | None = None,
               alone_prefill_tokens: int | None = None) -> Daemon:
    """Start one more worker registered with the cluster's coordinators."""
    args = ["--coordinators", ",".join(cluster.coordinator_addresses), "--worker-id", name, "--model", model,
            "--kv-dtype", kv_dtype, "--kv-cache", kv_cache]
    if blas_threads is not None:
        args += ["--blas-threads", str(blas_threads)]
    if max_prefill_tokens is not None:
        args += ["--max-prefill-tokens", str(max_prefill_tokens)]
    if alone_prefill_tokens is not None:
        args += ["--alone-prefill-tokens", str(alone_prefill_tokens)]
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
    """Client's keywords for a cluster started with `tls_dir`: its CA, which is all a client of the
    coordinators needs besides a token (a coordinator takes a client without a certificate:
    base/security.py); {} for plaintext."""
    if tls_dir is None:
        return {}
    return {"tls_ca": str(tls_dir / "ca.pem")}


def default_blas_threads(workers: int) -> int:
    """BLAS threads per worker when `workers` share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


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


def stop_members(members: list[dict]) -> None:
    """Stop a cluster file's members by pid, in stop order; SIGKILL those still running after 20 s.
    A pid that no longer runs a kvcache daemon is left alone (the number may have been reused)."""
    for member in _stop_order(members):
        _terminate(member["pid"])
    deadline = time.monotonic() + 20.0
    while any(_is_ours(m["pid"]) for m in members) and time.monotonic() < deadline:
        time.sleep(0.1)
    for member in members:
        if _is_ours(member["pid"]):
            os.kill(member["pid"], signal.SIGKILL)


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
