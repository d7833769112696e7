"""`kvcache bench eviction`: a prefix-sharing trace replayed against the kvnode's page
store (the real code, no network) at a sweep of capacities, under every eviction policy
(kvnode/eviction/): the node's prefix-safe ones beside plain LRU, FIFO, ARC, S3-FIFO and
LFU, the orders of remote stores that know nothing of prefixes.

The trace is generated (a chat service's shapes, kvcache/bench/prefix_trace.py; capacities
in % of its working set) or read with --trace FILE, in Mooncake's format
(kvcache/bench/mooncake_trace.py; capacities in % of its unique pages, 5/10/20/40 by default).

Each request does what a worker does: look its chain of page keys up (the longest cached
prefix is usable; pages after a missing one are not), then put the pages it had to
compute, parents first. Reported per policy and capacity: the hit rate in blocks and in
prompt tokens usable as cached prefix, their share of what a cache that never evicts
hits and of Belady's MIN (kvcache/bench/belady.py, computed offline: no online policy
hits more blocks), orphaned pages (cached, but their parent is gone, so no lookup from
the root reaches them) at the end and at their peak, evictions and refused puts.

--cost measures instead what one operation costs each policy at 1,000 to 100,000 pages
(kvcache/bench/eviction_cost.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvcache import __version__
from kvcache.bench.belady import belady
from kvcache.bench.mooncake_trace import TraceError, TraceRequest, infinite_cache_hits, read_trace, unique_pages
from kvcache.bench.prefix_trace import TraceConfig, generate
from kvcache.bench.report import dump_json, machine, print_table, progress, pyplot
from kvnode.eviction import ALIASES, NODE_POLICIES, POLICIES
from kvnode.store.page_store import PageStore

PAGE_BYTES = 16  # the bench counts pages, not bytes: keep the pool small
DEFAULT_CAPACITIES = "10,20,30,40,50,60,70,80,90,100"
DEFAULT_TRACE_CAPACITIES = "5,10,20,40"
MAX_REQUESTS = 1_000_000
GOAL_CAPACITY, GOAL_POINTS = 10, 3.0  # the best prefix-safe policy beats prefix-lru by 3 points at 10%


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", metavar="FILE",
                        help="replay this trace (Mooncake's JSONL format) instead of generating one")
    parser.add_argument("--requests", type=int, default=TraceConfig.requests,
                        help=f"requests in the generated trace (default {TraceConfig.requests})")
    parser.add_argument("--seed", type=int, default=0, help="generated trace's seed (default 0)")
    parser.add_argument("--capacities", default=None,
                        help=f"pool sizes in percent of the trace's distinct pages (default {DEFAULT_CAPACITIES}; "
                             f"{DEFAULT_TRACE_CAPACITIES} with --trace)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"eviction policies to compare (default {','.join(POLICIES)})")
    parser.add_argument("--cost", action="store_true",
                        help="measure each policy's cost per operation at --cost-pages instead of replaying a trace")
    parser.add_argument("--cost-pages", default="1000,10000,100000",
                        help="pool sizes for --cost, in pages (default 1000,10000,100000)")
    parser.add_argument("--cost-requests", type=int, default=20_000,
                        help="requests timed at each size for --cost (default 20000; fewer for a quick look)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--plot", metavar="DIR", help="also draw PNG charts into DIR (needs matplotlib: the bench extra)")


def run(args: argparse.Namespace) -> int:
    try:
        capacities, policies = _parse_options(args)
        plt = pyplot() if args.plot else None
        if args.cost:
            from kvcache.bench.eviction_cost import run_cost

            return run_cost(args, policies)
        requests, trace_info = _load_trace(args)
    except (ValueError, ImportError) as exc:
        print(f"kvcache bench eviction: error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    distinct = unique_pages(requests)
    total_blocks = sum(len(request.keys) for request in requests)
    prompt_tokens = sum(request.prompt_tokens for request in requests)
    infinite_blocks, infinite_tokens = infinite_cache_hits(requests)
    results, bounds = [], []
    steps = [(percent, policy) for percent in capacities for policy in [None] + policies]
    for percent, policy in progress(steps, "replaying"):
        capacity = max(1, round(distinct * percent / 100))
        figures = replay(requests, policy, capacity) if policy else belady(requests, capacity)
        figures.update(capacity_percent=percent, capacity_pages=capacity, policy=policy or "belady-min",
                       block_hit_rate=figures["hit_blocks"] / total_blocks,
                       hit_rate=figures["hit_tokens"] / prompt_tokens)
        figures["of_infinite"] = figures["hit_blocks"] / infinite_blocks if infinite_blocks else None
        (results if policy else bounds).append(figures)
    baseline = "lru" if "lru" in policies else policies[-1]
    for row in results:
        base = _row(results, baseline, row["capacity_percent"])
        bound = _row(bounds, "belady-min", row["capacity_percent"])
        row["hit_rate_vs_baseline"] = row["hit_rate"] / base["hit_rate"] if base["hit_rate"] else None
        row["of_belady"] = row["hit_blocks"] / bound["hit_blocks"] if bound["hit_blocks"] else None
    trace_info.update(requests=len(requests), prompt_tokens=prompt_tokens, page_lookups=total_blocks,
                      working_set_pages=distinct, infinite_block_hit_rate=infinite_blocks / total_blocks,
                      infinite_hit_rate=infinite_tokens / prompt_tokens)
    result = {
        "bench": "eviction",
        "machine": machine(),
        "versions": {"kvcache": __version__},
        "options": {k: v for k, v in vars(args).items() if k != "run"},
        "trace": trace_info,
        "baseline": baseline,
        "results": results,
        "bounds": bounds,
        "goal": goal(results),
        "seconds": time.perf_counter() - started,
    }
    if plt is not None:
        result["charts"] = draw_charts(plt, results, bounds, policies, trace_info, Path(args.plot))
    if args.json:
        dump_json(result, sys.stdout)  # the stdout of now (tests capture it)
    else:
        print_report(result)
    return 0


def _load_trace(args: argparse.Namespace) -> tuple[list[TraceRequest], dict]:
    if args.trace:
        try:
            requests = read_trace(args.trace)
        except TraceError as exc:
            raise ValueError(f"--trace: {exc}") from None
        return requests, {"file": Path(args.trace).name, "block_tokens": requests[0].block_tokens[0]}
    config = TraceConfig(requests=args.requests, seed=args.seed)
    generated = generate(config)
    requests = [TraceRequest(0, r.keys, (config.page_tokens,) * len(r.keys), r.prompt_tokens) for r in generated]
    kinds = {kind: sum(1 for r in generated if r.kind == kind) for kind in ("new", "turn", "one-off")}
    return requests, {"generated": True, "seed": args.seed, "page_tokens": config.page_tokens, "kinds": kinds}


def replay(requests: list[TraceRequest], policy: str, capacity_pages: int) -> dict:
    """Run the trace through a fresh store: lookup, then put the computed pages parents first."""
    store = PageStore(capacity_pages, PAGE_BYTES, policy=policy)
    data = bytes(PAGE_BYTES)
    hit_blocks = hit_tokens = 0
    peak_orphans = 0
    for request in requests:
        keys = request.keys
        hits = store.lookup(keys)
        hit_blocks += hits
        hit_tokens += sum(request.block_tokens[:hits])
        parent = keys[hits - 1] if hits else b""
        for key in keys[hits:]:
            store.put(key, parent, data)
            parent = key
        peak_orphans = max(peak_orphans, store.num_orphans())
    store.check_invariants()
    return {"hit_blocks": hit_blocks, "hit_tokens": hit_tokens, "orphans_end": store.num_orphans(),
            "orphans_peak": peak_orphans, "evictions": store.stats.evictions, "refused_puts": store.stats.refusals}


def goal(results: list[dict]) -> dict | None:
    """At 10%: the best prefix-safe policy against prefix-lru, in points of block hit rate."""
    rows = {r["policy"]: r for r in results if r["capacity_percent"] == GOAL_CAPACITY}
    others = [name for name in NODE_POLICIES if name in rows and name != "prefix-lru"]
    if "prefix-lru" not in rows or not others:
        return None
    best = max(others, key=lambda name: rows[name]["block_hit_rate"])
    points = 100 * (rows[best]["block_hit_rate"] - rows["prefix-lru"]["block_hit_rate"])
    return {"capacity_percent": GOAL_CAPACITY, "best": best, "points_over_prefix_lru": points,
            "met": points >= GOAL_POINTS}


def _row(rows: list[dict], policy: str, percent: float) -> dict:
    return next(r for r in rows if r["policy"] == policy and r["capacity_percent"] == percent)


def print_report(result: dict) -> None:
    trace = result["trace"]
    if trace.get("generated"):
        kinds = ", ".join(f"{n} {kind}" for kind, n in trace["kinds"].items())
        print(f"trace: {trace['requests']} requests ({kinds}), seed {trace['seed']}, {trace['prompt_tokens']} "
              f"prompt tokens in pages of {trace['page_tokens']}, working set {trace['working_set_pages']} pages")
    else:
        print(f"trace: {trace['file']}, {trace['requests']} requests, {trace['page_lookups']} blocks of "
              f"{trace['block_tokens']} tokens, {trace['working_set_pages']} distinct")
    print(f"a cache that never evicts hits {trace['infinite_block_hit_rate']:.3f} of blocks, "
          f"{trace['infinite_hit_rate']:.3f} of prompt tokens")
    baseline = result["baseline"]
    rows = []
    for bound in result["bounds"]:
        percent = bound["capacity_percent"]
        rows.append([f"{percent:g}%", bound["capacity_pages"], "belady-min (offline)", bound["block_hit_rate"],
                     bound["hit_rate"], bound["of_infinite"], 1.0, "-", "-", "-", "-", "-"])
        for r in (r for r in result["results"] if r["capacity_percent"] == percent):
            rows.append([f"{percent:g}%", r["capacity_pages"], r["policy"], r["block_hit_rate"], r["hit_rate"],
                         r["of_infinite"], r["of_belady"],
                         "-" if r["hit_rate_vs_baseline"] is None else r["hit_rate_vs_baseline"],
                         r["orphans_end"], r["orphans_peak"], r["evictions"], r["refused_puts"]])
    print_table(["capacity", "pages", "policy", "block hits", "token hits", "of infinite", "of MIN",
                 f"vs {baseline}", "orphans end", "orphans peak", "evictions", "refused puts"], rows, out=sys.stdout)
    found = result["goal"]
    if found is not None:
        print(f"goal: the best prefix-safe policy beats prefix-lru by {GOAL_POINTS:g} points of block hit rate at "
              f"{GOAL_CAPACITY}%: {'met' if found['met'] else 'NOT met'} ({found['best']}, "
              f"{found['points_over_prefix_lru']:+.1f} points)")
    if "charts" in result:
        print("charts: " + ", ".join(result["charts"]))
    print(f"({result['seconds']:.1f} s)")


def draw_charts(plt, results: list[dict], bounds: list[dict], policies: list[str], trace: dict,
                folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    prefix = "" if trace.get("generated") else "trace_"
    charts = []
    for field, label, name in [("hit_rate", "hit rate (prompt tokens usable as cached prefix)", "eviction_hit_rate.png"),
                               ("orphans_peak", "orphaned pages at their peak", "eviction_orphans.png")]:
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for policy in policies:
            mine = [r for r in results if r["policy"] == policy]
            axes.plot([r["capacity_percent"] for r in mine], [r[field] for r in mine], marker="o", label=policy,
                      linestyle="-" if policy in NODE_POLICIES else ":")
        if field == "hit_rate":
            axes.plot([b["capacity_percent"] for b in bounds], [b["hit_rate"] for b in bounds], color="black",
                      linewidth=2, label="Belady's MIN (offline)")
            axes.axhline(trace["infinite_hit_rate"], color="grey", linestyle="--", label="never evicts")
        axes.set_xlabel("pool capacity, % of the trace's distinct pages")
        axes.set_ylabel(label)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
        path = folder / (prefix + name)
        figure.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(figure)
        charts.append(str(path))
    return charts


def _parse_options(args: argparse.Namespace) -> tuple[list[float], list[str]]:
    if not 1 <= args.requests <= MAX_REQUESTS:
        raise ValueError(f"--requests must be between 1 and {MAX_REQUESTS}, got {args.requests}")
    text = args.capacities or (DEFAULT_TRACE_CAPACITIES if args.trace else DEFAULT_CAPACITIES)
    try:
        capacities = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--capacities takes comma-separated percentages, got {text!r}") from None
    if not all(0 < c <= 100 for c in capacities):
        raise ValueError(f"--capacities must each be above 0 and at most 100, got {text!r}")
    policies = [ALIASES.get(part.strip(), part.strip()) for part in args.policies.split(",")]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or len(set(policies)) != len(policies):
        raise ValueError(f"--policies takes distinct names from {', '.join(POLICIES)}, got {args.policies!r}")
    return sorted(set(capacities)), policies
