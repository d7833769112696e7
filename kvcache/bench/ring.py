"""`kvcache bench ring`: the cluster at 10 to 1,000 kvnodes, by simulation. A Mooncake-format
trace (--trace) is replayed through the coordinator's real ring (coordinator/ring.py:
uhashring, virtual nodes by capacity, the same placement key and replica count) over N
in-process page stores (the kvnode's real store, prefix-lru), as a worker would: look the
chain up on the first placed node, then put the pages it missed on every placed node.

The placement key is the coordinator's, of the request's first block id (the prompt's first
characters stand for it: requests that share their first block share their nodes). The
cluster's pages (--capacity, % of the trace's distinct pages) are split evenly over its
nodes; each node's capacity in bytes (--node-gib) sets its virtual nodes, as a real node's
pool does.

Reported per node count:
- the cluster's hit rate (blocks) without churn and with --churn (% of nodes a minute of
  trace time leave and as many new, empty ones join; a minute's changes are applied at once,
  one new ring each minute), beside one store of the cluster's whole capacity;
- keys moved when a node joins and when one leaves, against the ideal 1/(N+1) and 1/N, over
  100,000 random placement keys;
- max/mean share of the hash space per node (exact, from the ring's points) and max/mean pages
  stored per node at the end of the static run;
- the time to place one request (the ring's placement, what the coordinator calls) and to
  build a ring.
Goals: max/mean share <= 1.15 at 100+ nodes; keys moved on a join <= 1.1/(N+1); hit rate with
1% churn a minute within 5% of the static cluster's.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter

from kvcache import __version__
from kvcache.bench.eviction import replay
from kvcache.bench.mooncake_trace import TraceError, TraceRequest, read_trace, unique_pages
from kvcache.bench.report import dump_json, machine, print_table, progress
from coordinator.ring import Ring, placement_key
from kvnode.store.page_store import PageStore

PAGE_BYTES = 16
SAMPLE_KEYS = 100_000
MAX_NODES = 5_000
GIB = 2**30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", metavar="FILE", required=True, help="the trace to replay (Mooncake's JSONL format)")
    parser.add_argument("--nodes", default="10,100,1000", help="cluster sizes (default 10,100,1000)")
    parser.add_argument("--churn", type=float, default=1.0,
                        help="%% of nodes that leave (and as many that join) per minute of trace time (default 1)")
    parser.add_argument("--capacity", type=float, default=40.0,
                        help="the cluster's pages, %% of the trace's distinct pages (default 40)")
    parser.add_argument("--replicas", type=int, default=2, help="placed nodes per request (default 2, the coordinator's)")
    parser.add_argument("--node-gib", type=float, default=1.0,
                        help="each node's capacity in GiB, which sets its virtual nodes (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="which nodes leave (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    try:
        sizes = _parse_options(args)
        requests = read_trace(args.trace)
    except (ValueError, TraceError) as exc:
        print(f"kvcache bench ring: error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    distinct = unique_pages(requests)
    total_pages = max(1, round(distinct * args.capacity / 100))
    single = replay(requests, "prefix-lru", total_pages)
    total_blocks = sum(len(r.keys) for r in requests)
    rows = []
    for nodes in progress(sizes, "simulating"):
        row = {"nodes": nodes, "node_pages": max(1, total_pages // nodes)}
        row.update(movement(nodes, args))
        static = simulate(requests, nodes, args, churn=0.0)
        churned = simulate(requests, nodes, args, churn=args.churn)
        row.update(hit_rate=static["hit_blocks"] / total_blocks, hit_rate_churn=churned["hit_blocks"] / total_blocks,
                   pages_max_mean=static["pages_max_mean"], place_us=static["place_us"],
                   build_ms=churned["build_ms"], joins=churned["joins"], refused_puts=static["refused_puts"])
        rows.append(row)
    result = {"bench": "ring", "machine": machine(), "versions": {"kvcache": __version__},
              "options": {k: v for k, v in vars(args).items() if k != "run"},
              "trace": {"requests": len(requests), "blocks": total_blocks, "distinct_pages": distinct},
              "cluster_pages": total_pages, "single_store_hit_rate": single["hit_blocks"] / total_blocks,
              "results": rows, "goals": goals(rows, args.churn), "seconds": time.perf_counter() - started}
    if args.json:
        dump_json(result, sys.stdout)
    else:
        print_report(result)
    return 0


def node_names(count: int, start: int = 0) -> list[str]:
    return [f"10.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}:50051" for n in range(start, start + count)]


def simulate(requests: list[TraceRequest], num_nodes: int, args: argparse.Namespace, churn: float) -> dict:
    """The trace through a cluster of `num_nodes` stores; `churn` % of them replaced each minute."""
    node_pages = max(1, round(unique_pages(requests) * args.capacity / 100) // num_nodes)
    node_bytes = int(args.node_gib * GIB)
    stores = {name: PageStore(node_pages, PAGE_BYTES) for name in node_names(num_nodes)}
    builds = [time.perf_counter()]
    ring = Ring({name: node_bytes for name in stores})
    builds[0] = time.perf_counter() - builds[0]
    rng = random.Random(args.seed)
    born, owed, minute, joins = num_nodes, 0.0, 0, 0
    data = bytes(PAGE_BYTES)
    hit_blocks, place_s = 0, 0.0
    for request in requests:
        while churn and request.timestamp_ms >= (minute + 1) * 60_000:
            minute += 1
            owed += num_nodes * churn / 100
            count, owed = int(owed), owed - int(owed)
            if count:
                for name in rng.sample(sorted(stores), count):
                    del stores[name]
                for name in node_names(count, born):
                    stores[name] = PageStore(node_pages, PAGE_BYTES)
                born += count
                joins += count
                begin = time.perf_counter()
                ring = Ring({name: node_bytes for name in stores})
                builds.append(time.perf_counter() - begin)
        begin = time.perf_counter()
        placed = ring.placement(placement_key(request.keys[0].hex()), args.replicas)
        place_s += time.perf_counter() - begin
        keys = request.keys
        hits = stores[placed[0]].lookup(keys)
        hit_blocks += hits
        for name in placed:  # the worker writes what it computed to every placed node
            parent = keys[hits - 1] if hits else b""
            store = stores[name]
            for key in keys[hits:]:
                store.put(key, parent, data)
                parent = key
    used = [store.num_used() for store in stores.values()]
    return {"hit_blocks": hit_blocks, "place_us": place_s * 1e6 / len(requests), "joins": joins,
            "pages_max_mean": max(used) / (sum(used) / len(used)) if sum(used) else None,
            "build_ms": 1000 * sum(builds) / len(builds),
            "refused_puts": sum(store.stats.refusals for store in stores.values())}


def movement(num_nodes: int, args: argparse.Namespace) -> dict:
    """Share of keys whose primary changes when a node joins and when one leaves; max/mean share."""
    node_bytes = int(args.node_gib * GIB)
    names = node_names(num_nodes + 1)
    keys = [placement_key(f"key {n}") for n in range(SAMPLE_KEYS)]
    before = Ring({name: node_bytes for name in names[:num_nodes]})
    after = Ring({name: node_bytes for name in names})
    fewer = Ring({name: node_bytes for name in names[1:num_nodes]})
    first = [primary(before, k) for k in keys]
    joined = sum(1 for k, p in zip(keys, first) if primary(after, k) != p) / len(keys)
    left = sum(1 for k, p in zip(keys, first) if primary(fewer, k) != p) / len(keys)
    shares = ring_shares(before)
    return {"moved_join": joined, "ideal_join": 1 / (num_nodes + 1), "moved_leave": left, "ideal_leave": 1 / num_nodes,
            "share_max_mean": max(shares.values()) * num_nodes}


def primary(ring: Ring, key: str) -> str:
    """ring.primary(key) in O(log n): uhashring's get_node bisects; range(), which placement uses, copies
    the ring's points on every call (see the placement times)."""
    return ring._ring.get_node(key)


def ring_shares(ring: Ring) -> dict[str, float]:
    """Each node's exact share of the hash space: the arcs that end at its points (uhashring's continuum)."""
    runtime = ring._ring.runtime
    points = runtime._keys
    shares: Counter = Counter()
    previous = points[-1] - 2**128  # md5 points; the first arc wraps around
    for point in points:
        shares[runtime._ring[point]] += point - previous
        previous = point
    total = sum(shares.values())
    return {name: share / total for name, share in shares.items()}


def goals(rows: list[dict], churn: float) -> dict:
    big = [r for r in rows if r["nodes"] >= 100]
    return {
        "share_max_mean_le_1.15_at_100_plus": all(r["share_max_mean"] <= 1.15 for r in big) if big else None,
        "moved_join_le_1.1_ideal": all(r["moved_join"] <= 1.1 * r["ideal_join"] for r in rows),
        f"churn_{churn:g}pct_within_5pct_of_static": all(r["hit_rate_churn"] >= 0.95 * r["hit_rate"] for r in rows),
    }


def print_report(result: dict) -> None:
    trace = result["trace"]
    print(f"trace: {trace['requests']} requests, {trace['blocks']} blocks, {trace['distinct_pages']} distinct; "
          f"cluster capacity {result['cluster_pages']} pages; one store of that capacity hits "
          f"{result['single_store_hit_rate']:.3f} of blocks")
    churn = result["options"]["churn"]
    rows = [[r["nodes"], r["node_pages"], r["hit_rate"], r["hit_rate_churn"], r["joins"],
             f"{r['moved_join']:.4f} / {r['ideal_join']:.4f}", f"{r['moved_leave']:.4f} / {r['ideal_leave']:.4f}",
             r["share_max_mean"], "-" if r["pages_max_mean"] is None else r["pages_max_mean"], r["place_us"],
             r["build_ms"]] for r in result["results"]]
    print_table(["nodes", "pages/node", "hit rate", f"with {churn:g}%/min churn", "joins", "moved on join / ideal",
                 "moved on leave / ideal", "share max/mean", "pages max/mean", "place us", "ring build ms"], rows)
    for name, met in result["goals"].items():
        print(f"goal {name}: {'-' if met is None else 'met' if met else 'NOT met'}")
    print(f"({result['seconds']:.1f} s)")


def _parse_options(args: argparse.Namespace) -> list[int]:
    try:
        sizes = sorted({int(part) for part in args.nodes.split(",")})
    except ValueError:
        raise ValueError(f"--nodes takes comma-separated node counts, got {args.nodes!r}") from None
    if not sizes or not all(1 <= n <= MAX_NODES for n in sizes):
        raise ValueError(f"--nodes must each be between 1 and {MAX_NODES}, got {args.nodes!r}")
    if not 0 <= args.churn <= 100:
        raise ValueError(f"--churn must be between 0 and 100 (% a minute), got {args.churn}")
    if not 0 < args.capacity <= 100:
        raise ValueError(f"--capacity must be above 0 and at most 100, got {args.capacity}")
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if not 0 < args.node_gib <= 1024:
        raise ValueError(f"--node-gib must be above 0 and at most 1024, got {args.node_gib}")
    return sizes
