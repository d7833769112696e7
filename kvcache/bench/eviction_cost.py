"""`kvcache bench eviction --cost`: what one store operation costs each eviction policy as the
pool grows from 1,000 to 100,000 pages (every order is meant to be O(log n) amortized).

The workload is the eviction bench's in miniature: requests look up a chain of 4 pages and
put the pages they miss, parents first, over twice as many distinct chains as the pool
holds, picked at random (seeded), so about half the puts evict. The pool is filled and run
for as many requests again before the clock starts; then the time of --cost-requests requests
(20,000) is divided by the pages they looked up or put. It is timed twice: as a daemon runs, and with
Python's cyclic garbage collector paused (`gc.disable`) over the same requests on a fresh
store, since the collector walks every live object of the store now and then: the second
figure is the policy's own work, the difference what a larger heap of objects costs.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time

from kvcache import __version__
from kvcache.bench.report import dump_json, machine, print_table, progress
from kvnode.store.page_store import KEY_BYTES, PageStore

CHAIN_PAGES = 4
MAX_COST_PAGES = 1_000_000
MAX_COST_REQUESTS = 10_000_000


def run_cost(args: argparse.Namespace, policies: list[str]) -> int:
    try:
        sizes = [int(part) for part in args.cost_pages.split(",")]
    except ValueError:
        sizes = []
    if not sizes or not all(CHAIN_PAGES <= n <= MAX_COST_PAGES for n in sizes):
        print(f"kvcache bench eviction: error: --cost-pages takes comma-separated page counts from {CHAIN_PAGES} "
              f"to {MAX_COST_PAGES}, got {args.cost_pages!r}", file=sys.stderr)
        return 2
    if not 1 <= args.cost_requests <= MAX_COST_REQUESTS:
        print(f"kvcache bench eviction: error: --cost-requests must be from 1 to {MAX_COST_REQUESTS}, "
              f"got {args.cost_requests}", file=sys.stderr)
        return 2
    sizes = sorted(set(sizes))
    started = time.perf_counter()
    rows = []
    for policy, pages in progress([(p, n) for p in policies for n in sizes], "timing"):
        rows.append({"policy": policy, "pages": pages, "us_per_page_op": cost(policy, pages, args.cost_requests),
                     "us_per_page_op_gc_paused": cost(policy, pages, args.cost_requests, collector=False)})
    result = {"bench": "eviction-cost", "machine": machine(), "versions": {"kvcache": __version__},
              "options": {"cost_pages": sizes, "policies": policies, "timed_requests": args.cost_requests},
              "results": rows, "seconds": time.perf_counter() - started}
    if args.json:
        dump_json(result, sys.stdout)
        return 0
    table = []
    for policy in policies:
        mine = {r["pages"]: r for r in rows if r["policy"] == policy}
        with_gc = [mine[n]["us_per_page_op"] for n in sizes]
        paused = [mine[n]["us_per_page_op_gc_paused"] for n in sizes]
        table.append([policy, *with_gc, with_gc[-1] / with_gc[0], *paused, paused[-1] / paused[0]])
    print_table(["policy", *(f"us/op at {n:,}" for n in sizes), f"{sizes[-1]:,} / {sizes[0]:,}",
                 *(f"gc paused at {n:,}" for n in sizes), "gc paused ratio"], table)
    print(f"(per page looked up or put; a cost growing as log n would grow {_log_ratio(sizes):.2f}x "
          f"from {sizes[0]:,} to {sizes[-1]:,} pages, as n {sizes[-1] / sizes[0]:.0f}x; {result['seconds']:.1f} s)")
    return 0


def cost(policy: str, capacity_pages: int, timed_requests: int, collector: bool = True) -> float:
    """Microseconds per page looked up or put, once the pool is full and evicting; with the
    cyclic garbage collector paused during the timed requests when `collector` is False."""
    rng = random.Random(capacity_pages)
    num_chains = 2 * capacity_pages // CHAIN_PAGES
    store = PageStore(capacity_pages, 16, policy=policy)
    data = bytes(16)
    warm = [rng.randrange(num_chains) for _ in range(2 * num_chains)]
    timed = [rng.randrange(num_chains) for _ in range(timed_requests)]
    chains = {c: [(c * CHAIN_PAGES + i).to_bytes(KEY_BYTES, "big") for i in range(CHAIN_PAGES)]
              for c in set(warm) | set(timed)}
    _requests(store, [chains[c] for c in warm], data)
    timed_chains = [chains[c] for c in timed]
    paused = not collector and gc.isenabled()
    if paused:
        gc.collect()
        gc.disable()
    try:
        begin = time.perf_counter()
        _requests(store, timed_chains, data)
        return (time.perf_counter() - begin) * 1e6 / (len(timed) * CHAIN_PAGES)
    finally:
        if paused:
            gc.enable()


def _requests(store: PageStore, requests: list[list[bytes]], data: bytes) -> None:
    for keys in requests:
        hits = store.lookup(keys)
        parent = keys[hits - 1] if hits else b""
        for key in keys[hits:]:
            store.put(key, parent, data)
            parent = key


def _log_ratio(sizes: list[int]) -> float:
    import math

    return math.log(sizes[-1]) / math.log(sizes[0])
