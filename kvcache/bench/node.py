"""`kvcache bench node`: kvnode put/get throughput and latency beside a raw loopback TCP
socket moving the same bytes in the same run, and the cost of a lookup as the index grows.

Batches are interleaved (node get, socket get, node put, socket put, ..., which side goes
first alternating) so both sides see the same machine load. Defaults: batches of 16 pages
of 589,824 bytes, one page of 16 tokens of a GPT-2-small-sized model in float16.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from kvcache.bench.loopback import SocketBaseline
from kvcache.bench.report import dump_json, latency_summary_ms, machine, print_table
from kvcache.launch import Daemon
from kvnode.client import NodeClient
from kvnode.store import PageStore
from protos import serving

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
    for op in ("get", "put"):
        node, raw = transfer["node"][op], transfer["socket"][op]
        rows.append([op, node["gb_per_s"], raw["gb_per_s"], node["gb_per_s"] / raw["gb_per_s"],
                     node["p50_ms"], node["p99_ms"], raw["p50_ms"], raw["p99_ms"]])
    print_table(["op", "node GB/s", "socket GB/s", "node/socket", "node p50 ms", "node p99 ms", "socket p50 ms",
                 "socket p99 ms"], rows)
    print()
    print("lookup + touch on the page store (no network):")
    print_table(["cached pages", "lookup 1 key us", "lookup 32-key chain us"],
                [[r["cached_pages"], r["single_key_us"], r["chain_us"]] for r in lookup])
    return 0


# ---- transfer ---------------------------------------------------------------------


def measure_transfer(args: argparse.Namespace) -> dict:
    node_daemon = None
    address = args.address
    if address is None:
        capacity = args.page_bytes * args.pages_per_batch * 8
        node_daemon = Daemon("node", ["--port", "0", "--page-bytes", str(args.page_bytes), "--capacity", str(capacity)])
        address = node_daemon.address
    try:
        with NodeClient(address, timeout=60.0) as client, SocketBaseline() as raw:
            return _interleaved(client, raw, args)
    finally:
        if node_daemon is not None:
            node_daemon.stop()


def _interleaved(client: NodeClient, raw: SocketBaseline, args: argparse.Namespace) -> dict:
    page_bytes = client.info().page_bytes
    n = args.pages_per_batch
    rng = np.random.default_rng(0)
    pages = rng.integers(0, 256, size=(n, page_bytes), dtype=np.uint8)
    out = np.empty_like(pages)
    get_keys = [os.urandom(16) for _ in range(n)]
    client.put_pages(get_keys, [b""] * n, pages)
    batch_bytes = pages.nbytes
    times: dict[str, dict[str, list[float]]] = {"node": {"get": [], "put": []}, "socket": {"get": [], "put": []}}

    def node_get():
        client.get_pages(get_keys, out=out)

    def node_put():
        client.put_pages([os.urandom(16) for _ in range(n)], [b""] * n, pages)  # fresh keys: a real store

    def socket_get():
        raw.get(out)

    def socket_put():
        raw.put(pages)

    ops = [("node", "get", node_get), ("socket", "get", socket_get), ("node", "put", node_put), ("socket", "put", socket_put)]
    for i in range(args.warmup + args.batches):
        # Odd rounds swap the sides, so neither always runs first after the puts.
        for side, op, fn in ops if i % 2 == 0 else [ops[1], ops[0], ops[3], ops[2]]:
            start = time.perf_counter()
            fn()
            if i >= args.warmup:
                times[side][op].append(time.perf_counter() - start)
    got = client.get_pages(get_keys)
    if not np.array_equal(got, pages):
        raise RuntimeError("the node returned different bytes than were stored")

    def summary(samples: list[float]) -> dict:
        return {"gb_per_s": batch_bytes * len(samples) / sum(samples) / 1e9, **latency_summary_ms(samples)}

    return {
        "page_bytes": page_bytes,
        "batch_bytes": batch_bytes,
        "node": {op: summary(t) for op, t in times["node"].items()},
        "socket": {op: summary(t) for op, t in times["socket"].items()},
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
