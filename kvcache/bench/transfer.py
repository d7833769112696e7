"""`kvcache bench transfer`: the same pages fetched and stored through a kvnode (over its data
plane, the path NodeClient takes, and over gRPC, as separate rows), through Redis and through
a raw loopback TCP socket, interleaved in one run: GB/s and p50/p99 latency per batch, for
get and put, each beside Redis and the socket with the ratio.

Batches are interleaved (kvnode get, redis get, socket get, kvnode put, ..., the order rotating
every round) so every transport sees the same machine load. Each get lands in one reused (pages, page_bytes)
array, as a worker's fetch would. Puts store fresh pages: new keys on the kvnode (which
evicts, its pool holding 8 batches), and on Redis a rotation over 8 batches of keys, each
SET replacing a whole value. Defaults: batches of 16 pages of 589,824 bytes, one page of
16 tokens of a GPT-2-small-sized model in float16.

With --tls a second kvnode runs with mutual TLS (certificates made for the run in a temporary
folder) and its data plane is one more row, interleaved with the others; its ratio to the
plaintext data plane is printed (the goal: a TLS fetch at 0.6 of plaintext or better).

Every kvnode row goes over TCP, as between hosts: the clients do not take the node's same-host
Unix socket (`kvcache bench node` has a row for it), so Redis, the raw socket and TLS are
compared on the wire they would share across a network.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from base import security, serving
from kvcache.bench import redis_baseline
from kvcache.bench.loopback import SocketBaseline
from kvcache.bench.node import GPT2_SMALL_FP16_PAGE
from kvcache.bench.report import dump_json, latency_summary_ms, machine, print_table, pyplot, rotated_order, versions
from kvcache.cluster import tls_args
from kvcache.launch import Daemon
from kvnode.client import NodeClient

TRANSPORTS = ("kvnode", "kvnode_grpc", "redis", "socket")  # "kvnode": its data plane
TLS = "kvnode_tls"  # with --tls: a kvnode's data plane over mutual TLS
LABELS = {"kvnode": "kvnode data plane", "kvnode_grpc": "kvnode gRPC", "redis": "redis", "socket": "raw socket",
          TLS: "kvnode data plane, TLS"}
TLS_GOAL = 0.6  # TLS fetch GB/s over the plaintext data plane's
OPS = ("get", "put")
RING_BATCHES = 8  # the kvnode's pool and Redis's put keys hold this many batches


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page-bytes", type=int, default=GPT2_SMALL_FP16_PAGE,
                        help=f"bytes per page (default {GPT2_SMALL_FP16_PAGE}, GPT-2 small, 16 tokens, float16)")
    parser.add_argument("--pages-per-batch", type=int, default=16, help="pages per get or put (default 16)")
    parser.add_argument("--batches", type=int, default=50, help="measured batches per transport and op (default 50)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured batches first (default 3)")
    parser.add_argument("--redis-server", default="redis-server", help="redis-server command (default: from PATH)")
    parser.add_argument("--tls", action="store_true",
                        help="also measure a kvnode's data plane over mutual TLS, beside plaintext, and print the ratio")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--plot", metavar="DIR", help="also write a bar chart of GB/s per transport (PNG) into DIR")


def run(args: argparse.Namespace) -> int:
    error = _invalid(args)
    if error:
        print(f"kvcache bench transfer: error: {error}", file=sys.stderr)
        return 2
    serving.tune_allocator()  # as the daemons do: this process is the client side
    result = {
        "bench": "transfer",
        "machine": machine(),
        "versions": {**versions(), **redis_baseline.versions(args.redis_server)},
        "options": {k: v for k, v in vars(args).items() if k != "run"},
        **measure(args),
    }
    if args.plot:
        result["plot"] = str(plot(result, Path(args.plot)))
    if args.json:
        dump_json(result)
    else:
        print_report(result)
    return 0


def _invalid(args: argparse.Namespace) -> str | None:
    if min(args.page_bytes, args.pages_per_batch, args.batches) < 1 or args.warmup < 0:
        return "--page-bytes, --pages-per-batch and --batches must be positive, --warmup not negative"
    if args.plot:
        try:
            pyplot()
        except ImportError as exc:
            return f"--plot: {exc}"
        if Path(args.plot).exists() and not Path(args.plot).is_dir():
            return f"--plot {args.plot} is a file, not a directory"
    return None


# ---- measuring --------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict:
    n, page_bytes = args.pages_per_batch, args.page_bytes
    batch_bytes = n * page_bytes
    with contextlib.ExitStack() as stack:
        node = stack.enter_context(Daemon("node", [
            "--port", "0", "--page-bytes", str(page_bytes), "--capacity", str(batch_bytes * RING_BATCHES)]))
        client = stack.enter_context(NodeClient(node.address, timeout=60.0, unix_socket=False))
        grpc_client = stack.enter_context(NodeClient(node.address, timeout=60.0, use_data_plane=False))
        if client.data_plane_address() is None:
            raise RuntimeError("the kvnode started for the bench serves no data plane")
        raw = stack.enter_context(SocketBaseline())
        redis_missing = redis_baseline.why_unavailable(args.redis_server)
        redis = None
        if redis_missing is None:
            redis = stack.enter_context(redis_baseline.RedisBaseline(
                args.redis_server, max_memory_bytes=batch_bytes * (RING_BATCHES + 2) + 64 * 2**20))
        tls_client = _tls_client(stack, page_bytes, batch_bytes) if args.tls else None
        times = _interleaved(client, grpc_client, redis, raw, n, page_bytes, args.warmup, args.batches, tls_client)
        wires = {"kvnode": client.data_plane_transport(),
                 **({TLS: tls_client.data_plane_transport()} if tls_client is not None else {})}

    transports: dict[str, dict] = {}
    for name in TRANSPORTS + ((TLS,) if args.tls else ()):
        if name == "redis" and redis_missing:
            transports[name] = {"missing": redis_missing}
            continue
        transports[name] = {op: _summary(times[name][op], batch_bytes) for op in OPS}
    return {"page_bytes": page_bytes, "batch_bytes": batch_bytes, "transports": transports,
            "data_plane_wire": wires, "ratios": ratios(transports)}


def _tls_client(stack: contextlib.ExitStack, page_bytes: int, batch_bytes: int) -> NodeClient:
    """A kvnode with mutual TLS on both ports, certificates made for this run, and a member's client of it."""
    from kvcache.certs import make_certs  # cryptography: only when asked for

    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcache-bench-tls-")))
    make_certs(folder)
    node = stack.enter_context(Daemon("node", [
        "--port", "0", "--page-bytes", str(page_bytes), "--capacity", str(batch_bytes * RING_BATCHES),
        *tls_args(folder, "node")]))
    credentials = security.Credentials(folder / "ca.pem", folder / "worker.pem", folder / "worker.key")
    client = stack.enter_context(NodeClient(node.address, timeout=60.0, credentials=credentials, unix_socket=False))
    if client.data_plane_address() is None:
        raise RuntimeError("the TLS kvnode started for the bench serves no data plane")
    return client


def _interleaved(client: NodeClient, grpc_client: NodeClient, redis, raw: SocketBaseline, n: int, page_bytes: int,
                 warmup: int, batches: int, tls_client: NodeClient | None = None) -> dict[str, dict[str, list[float]]]:
    rng = np.random.default_rng(0)
    pages = rng.integers(0, 256, size=(n, page_bytes), dtype=np.uint8)
    out = np.empty_like(pages)
    node_keys = [os.urandom(16) for _ in range(n)]
    client.put_pages(node_keys, [b""] * n, pages)
    redis_keys = [b"get:%d" % i for i in range(n)]
    redis_put_keys = [[b"put:%d:%d" % (b, i) for i in range(n)] for b in range(RING_BATCHES)]
    if redis is not None:
        redis.put(redis_keys, pages)

    ops = {
        ("kvnode", "get"): lambda i: client.get_pages(node_keys, out=out),
        ("kvnode", "put"): lambda i: client.put_pages([os.urandom(16) for _ in range(n)], [b""] * n, pages),
        ("kvnode_grpc", "get"): lambda i: grpc_client.get_pages(node_keys, out=out),
        ("kvnode_grpc", "put"): lambda i: grpc_client.put_pages([os.urandom(16) for _ in range(n)], [b""] * n, pages),
        ("socket", "get"): lambda i: raw.get(out),
        ("socket", "put"): lambda i: raw.put(pages),
    }
    if redis is not None:
        ops[("redis", "get")] = lambda i: redis.get(redis_keys, out)
        ops[("redis", "put")] = lambda i: redis.put(redis_put_keys[i % RING_BATCHES], pages)
    if tls_client is not None:
        tls_client.put_pages(node_keys, [b""] * n, pages)
        ops[(TLS, "get")] = lambda i: tls_client.get_pages(node_keys, out=out)
        ops[(TLS, "put")] = lambda i: tls_client.put_pages([os.urandom(16) for _ in range(n)], [b""] * n, pages)
    times: dict[str, dict[str, list[float]]] = {t: {op: [] for op in OPS} for t in (*TRANSPORTS, TLS)}
    for i in range(warmup + batches):
        for transport, op in rotated_order([t for t in (*TRANSPORTS, TLS) if (t, "get") in ops], i):
            start = time.perf_counter()
            ops[(transport, op)](i)
            if i >= warmup:
                times[transport][op].append(time.perf_counter() - start)

    for transport, fetch in ((t, ops.get((t, "get"))) for t in ("kvnode", "kvnode_grpc", "redis", TLS)):
        if fetch is not None:
            out[:] = 0
            fetch(0)
            if not np.array_equal(out, pages):
                raise RuntimeError(f"{transport} returned different bytes than were stored")
    return times


def _summary(samples: list[float], batch_bytes: int) -> dict:
    return {"gb_per_s": batch_bytes * len(samples) / sum(samples) / 1e9, "batches": len(samples),
            **latency_summary_ms(samples)}


def ratios(transports: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """GB/s of each transport over Redis's and over the socket's, per op ("kvnode/redis": 1.2, ...);
    with TLS measured, also "kvnode_tls/kvnode" (TLS over the plaintext data plane)."""
    found: dict[str, dict[str, float | None]] = {}
    for op in OPS:
        found[op] = {}
        if TLS in transports:
            found[op][f"{TLS}/kvnode"] = transports[TLS][op]["gb_per_s"] / transports["kvnode"][op]["gb_per_s"]
        for name in (t for t in TRANSPORTS if t in transports):
            for base in ("redis", "socket"):
                if name == base:
                    continue
                a, b = transports[name].get(op), transports[base].get(op)
                found[op][f"{name}/{base}"] = a["gb_per_s"] / b["gb_per_s"] if a and b else None
    return found


# ---- output -----------------------------------------------------------------------


def print_report(result: dict) -> None:
    options, transports = result["options"], result["transports"]
    print(f"transfer: {options['batches']} batches of {options['pages_per_batch']} pages x {result['page_bytes']} bytes "
          f"({result['batch_bytes'] / 2**20:.1f} MiB), interleaved; the kvnode data plane over "
          f"{', '.join(sorted(set(result['data_plane_wire'].values())))} (as between hosts)")
    rows = []
    for op in OPS:
        for name in (t for t in (*TRANSPORTS, TLS) if t in transports):
            figures = transports[name]
            if "missing" in figures:
                rows.append([op, LABELS[name], "-", "-", "-", "-", "-", figures["missing"]])
                continue
            f = figures[op]
            rows.append([op, LABELS[name], f["gb_per_s"], f["p50_ms"], f["p99_ms"],
                         _ratio(f, transports["redis"].get(op)), _ratio(f, transports["socket"][op]), ""])
    print_table(["op", "transport", "GB/s", "p50 ms", "p99 ms", "x redis", "x socket", "note"], rows)
    if TLS in transports:
        get, put = (result["ratios"][op][f"{TLS}/kvnode"] for op in OPS)
        print(f"\nTLS data plane / plaintext: get {get:.2f}x, put {put:.2f}x "
              f"(goal: get >= {TLS_GOAL}: {'met' if get >= TLS_GOAL else 'not met'})")
    if "plot" in result:
        print(f"\nchart: {result['plot']}")


def _ratio(figures: dict, base: dict | None) -> float | str:
    return figures["gb_per_s"] / base["gb_per_s"] if base else "-"


def plot(result: dict, folder: Path) -> Path:
    """A grouped bar chart of GB/s per transport, get and put side by side; returns the PNG's path."""
    plt = pyplot()
    transports = result["transports"]
    names = [t for t in (*TRANSPORTS, TLS) if t in transports and "missing" not in transports[t]]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for k, op in enumerate(OPS):
        xs = [i + (k - 0.5) * width for i in range(len(names))]
        values = [transports[t][op]["gb_per_s"] for t in names]
        bars = ax.bar(xs, values, width, label=op)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(names)), [LABELS[t] for t in names], fontsize=8)
    ax.set_ylabel("GB/s (higher is better)")
    missing = [f"{t}: {transports[t]['missing']}" for t in TRANSPORTS if "missing" in transports[t]]
    ax.set_title(f"batches of {result['options']['pages_per_batch']} pages x {result['page_bytes']:,} bytes"
                 + ("\n" + "; ".join(missing) if missing else ""), fontsize=9)
    ax.legend()
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "transfer_gbps.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
