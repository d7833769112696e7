"""`kvcache bench node`: kvnode put/get throughput and latency, over its data plane (pages
copied out of its shared pool, its same-host Unix socket and TCP, as separate rows) and over gRPC, beside a raw loopback TCP
socket moving the same bytes in the same run, and the cost of a lookup as the index grows.

Batches are interleaved (every path's get, then every path's put, the order rotating each
round) so every path sees the same machine load. Defaults: batches of 16 pages of 589,824
bytes, one page of 16 tokens of a GPT-2-small-sized model in float16.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from base import serving
from kvcache.bench.loopback import SocketBaseline
from kvcache.bench.report import dump_json, latency_summary_ms, machine, print_table, rotated_order
from kvcache.launch import Daemon
from kvnode.client import NodeClient
from kvnode.store.page_store import PageStore

GPT2_SMALL_FP16_PAGE = 12 * 2 * 12 * 16 * 64 * 2  # 589,824 bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="measure a running node (its --page-bytes is used); default: start one")
    parser.add_argument("--page-bytes", type=int, default=GPT2_SMALL_FP16_PAGE, help="page size when starting a node")
    parser.add_argument("--pages-per-batch", type=int, default=16, help="pages per put or get (default 16)")
    parser.add_argument("--batches", type=int, default=100, help="measured batches per operation (default 100)")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured batches first (default 5)")
    parser.add_argument(
        "--index-sizes", default="1000,100000", help="cached page counts for the lookup cost (default 1000,100000)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args: argparse.Namespace) -> int:
    if min(args.pages_per_batch, args.batches, args.page_bytes) < 1 or args.warmup < 0:
        print("kvcache bench node: error: --pages-per-batch, --batches and --page-bytes must be positive", file=sys.stderr)
        return 2
    try:
        index_sizes = [int(n) for n in args.index_sizes.split(",")]
    except ValueError:
        print(f"kvcache bench node: error: --index-sizes takes comma-separated counts, got {args.index_sizes!r}", file=sys.stderr)
        return 2
    serving.tune_allocator()  # as the daemons do: this process is the client side
    transfer = measure_transfer(args)
    lookup = [measure_lookup(n) for n in index_sizes]
    result = {"bench": "node", "machine": machine(), "options": {k: v for k, v in vars(args).items() if k != "run"}, "transfer": transfer, "lookup": lookup}
    if args.json:
        dump_json(result)
        return 0
    batch_mib = transfer["batch_bytes"] / 2**20
    print(f"transfer: {args.batches} batches of {args.pages_per_batch} pages x {transfer['page_bytes']} bytes ({batch_mib:.1f} MiB)")
    rows = []
    for op in OPS:
        raw = transfer["socket"][op]
        for side in SIDES:
            figures = transfer[side]
            if "missing" in figures:
                rows.append([op, LABELS[side], "-", "-", "-", "-", figures["missing"]])
                continue
            f = figures[op]
            rows.append([op, LABELS[side], f["gb_per_s"], f["gb_per_s"] / raw["gb_per_s"], f["p50_ms"], f["p99_ms"], ""])
    print_table(["op", "path", "GB/s", "x socket", "p50 ms", "p99 ms", "note"], rows)
    print()
    print("lookup + touch on the page store (no network):")
    print_table(["cached pages", "lookup 1 key us", "lookup 32-key chain us"],
                [[r["cached_pages"], r["single_key_us"], r["chain_us"]] for r in lookup])
    return 0


# ---- transfer ---------------------------------------------------------------------

OPS = ("get", "put")
SIDES = ("node_shared", "node_unix", "node", "node_grpc", "socket")  # "node": the data plane over TCP
LABELS = {"node_shared": "node data plane, shared pool", "node_unix": "node data plane, unix socket", "node": "node data plane, TCP", "node_grpc": "node gRPC",
          "socket": "raw TCP socket"}


def measure_transfer(args: argparse.Namespace) -> dict:
    node_daemon = None
    address = args.address
    if address is None:
        capacity = args.page_bytes * args.pages_per_batch * 8
        node_daemon = Daemon("node", ["--port", "0", "--page-bytes", str(args.page_bytes), "--capacity", str(capacity)])
        address = node_daemon.address
    try:
        with NodeClient(address, timeout=60.0) as shared_client, \
                NodeClient(address, timeout=60.0, shared_memory=False) as unix_client, \
                NodeClient(address, timeout=60.0, unix_socket=False) as client, \
                NodeClient(address, timeout=60.0, use_data_plane=False) as grpc_client, SocketBaseline() as raw:
            return _interleaved(shared_client, unix_client, client, grpc_client, raw, args)
    finally:
        if node_daemon is not None:
            node_daemon.stop()


def _interleaved(shared_client: NodeClient, unix_client: NodeClient, client: NodeClient, grpc_client: NodeClient, raw: SocketBaseline,
                 args: argparse.Namespace) -> dict:
    page_bytes = client.info().page_bytes
    n = args.pages_per_batch
    rng = np.random.default_rng(0)
    pages = rng.integers(0, 256, size=(n, page_bytes), dtype=np.uint8)
    out = np.empty_like(pages)
    get_keys = [os.urandom(16) for _ in range(n)]
    grpc_client.put_pages(get_keys, [b""] * n, pages)
    batch_bytes = pages.nbytes
    clients = {"node_shared": shared_client, "node_unix": unix_client, "node": client, "node_grpc": grpc_client}
    missing = {}
    if client.data_plane_address() is None:
        missing["node"] = "the node serves no data plane (started with --no-data-plane?)"
    unix_client.get_pages(get_keys[:1])  # a client that finds no unix socket goes on over TCP
    if unix_client.data_plane_transport() != "unix":
        missing["node_unix"] = "no unix socket (node on another host, or --no-data-unix / --no-data-plane)"
    if not shared_client.map_shared_pool(timeout=60.0):  # puts go over the unix socket all the same
        missing["node_shared"] = "no shared pool (node on another host, with TLS, or --no-shared-pool; see its log)"

    def node_ops(c: NodeClient) -> dict:
        return {"get": lambda: c.get_pages(get_keys, out=out),
                # fresh keys: a real store, evicting as the pool fills
                "put": lambda: c.put_pages([os.urandom(16) for _ in range(n)], [b""] * n, pages)}

    ops = {side: node_ops(c) for side, c in clients.items() if side not in missing}
    ops["socket"] = {"get": lambda: raw.get(out), "put": lambda: raw.put(pages)}
    times: dict[str, dict[str, list[float]]] = {side: {op: [] for op in OPS} for side in ops}
    for i in range(args.warmup + args.batches):
        for side, op in rotated_order(list(ops), i):
            start = time.perf_counter()
            ops[side][op]()
            if i >= args.warmup:
                times[side][op].append(time.perf_counter() - start)
    for side, c in clients.items():
        if side not in missing and not np.array_equal(c.get_pages(get_keys), pages):
            raise RuntimeError(f"the node returned different bytes than were stored ({LABELS[side]})")

    def summary(samples: list[float]) -> dict:
        return {"gb_per_s": batch_bytes * len(samples) / sum(samples) / 1e9, **latency_summary_ms(samples)}

    return {
        "page_bytes": page_bytes,
        "batch_bytes": batch_bytes,
        **{side: {"missing": why} for side, why in missing.items()},
        **{side: {op: summary(t) for op, t in per_op.items()} for side, per_op in times.items()},
    }


# ---- lookup cost ------------------------------------------------------------------


def measure_lookup(cached_pages: int, chain_len: int = 32, samples: int = 20_000) -> dict:
    """Microseconds per lookup on a store holding `cached_pages` pages in chains of `chain_len`."""
    store = PageStore(cached_pages, page_bytes=16)
    data = bytes(16)
    chains = []
    for _ in range(max(1, cached_pages // chain_len)):
        keys = [os.urandom(16) for _ in range(chain_len)]
        for parent, key in zip([b"", *keys[:-1]], keys):
            store.put(key, parent, data)
        chains.append(keys)
    rng = np.random.default_rng(1)
    picks = rng.integers(0, len(chains), size=samples)
    singles = [chains[i][-1] for i in picks]
    start = time.perf_counter()
    for key in singles:
        store.lookup((key,))
    single_us = (time.perf_counter() - start) / samples * 1e6
    start = time.perf_counter()
    for i in picks[: samples // 10]:
        store.lookup(chains[i])
    chain_us = (time.perf_counter() - start) / (samples // 10) * 1e6
    return {"cached_pages": store.num_used(), "single_key_us": single_us, "chain_us": chain_us, "chain_len": chain_len}
