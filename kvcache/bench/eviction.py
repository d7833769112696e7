"""`kvcache bench eviction`: a prefix-sharing trace replayed against the kvnode's page
store (the real code, no network) at capacities from 10% to 100% of the trace's working
set, under the node's prefix-aware policy beside plain LRU and FIFO, the policies of
remote stores that know nothing of prefixes (kvnode/eviction.py).

Each request does what a worker does: look its chain of page keys up (the longest cached
prefix is usable; pages after a missing one are not), then put the pages it had to
compute, parents first. Reported per policy and capacity: the hit rate (prompt tokens
usable as cached prefix), orphaned pages (cached, but their parent is gone, so no lookup
from the root reaches them) at the end and at their peak, evictions and refused puts.
At 100% nothing is evicted, so every policy has the same hit rate, the trace's ceiling.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvcache import __version__
from kvcache.bench.prefix_trace import TraceConfig, generate, working_set_pages
from kvcache.bench.report import dump_json, machine, print_table, progress, pyplot
from kvnode.eviction import ALIASES, POLICIES
from kvnode.store import PageStore

PAGE_BYTES = 16  # the bench counts pages, not bytes: keep the pool small
DEFAULT_CAPACITIES = "10,20,30,40,50,60,70,80,90,100"
MAX_REQUESTS = 1_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=TraceConfig.requests,
                        help=f"requests in the trace (default {TraceConfig.requests})")
    parser.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    parser.add_argument("--capacities", default=DEFAULT_CAPACITIES,
                        help=f"pool sizes in percent of the working set (default {DEFAULT_CAPACITIES})")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"eviction policies to compare (default {','.join(POLICIES)})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--plot", metavar="DIR", help="also draw PNG charts into DIR (needs matplotlib: the bench extra)")


def run(args: argparse.Namespace) -> int:
    try:
        capacities, policies = _parse_options(args)
        plt = pyplot() if args.plot else None
    except (ValueError, ImportError) as exc:
        print(f"kvcache bench eviction: error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    config = TraceConfig(requests=args.requests, seed=args.seed)
    trace = generate(config)
    working_set = working_set_pages(trace)
    prompt_tokens = sum(request.prompt_tokens for request in trace)
    results = []
    steps = [(percent, policy) for percent in capacities for policy in policies]
    for percent, policy in progress(steps, "replaying"):
        capacity = max(1, round(working_set * percent / 100))
        figures = replay(trace, policy, capacity, config.page_tokens)
        figures.update(capacity_percent=percent, capacity_pages=capacity, policy=policy,
                       hit_rate=figures["hit_tokens"] / prompt_tokens)
        results.append(figures)
    baseline = "lru" if "lru" in policies else policies[-1]
    for row in results:
        base = next(r for r in results if r["policy"] == baseline and r["capacity_percent"] == row["capacity_percent"])
        row["hit_rate_vs_baseline"] = row["hit_rate"] / base["hit_rate"] if base["hit_rate"] else None
    result = {
        "bench": "eviction",
        "machine": machine(),
        "versions": {"kvcache": __version__},
        "options": {k: v for k, v in vars(args).items() if k != "run"},
        "trace": {"requests": len(trace), "prompt_tokens": prompt_tokens, "page_tokens": config.page_tokens,
                  "page_lookups": sum(len(request.keys) for request in trace), "working_set_pages": working_set,
                  "kinds": {kind: sum(1 for r in trace if r.kind == kind) for kind in ("new", "turn", "one-off")}},
        "baseline": baseline,
        "results": results,
        "seconds": time.perf_counter() - started,
    }
    if plt is not None:
        result["charts"] = draw_charts(plt, results, policies, Path(args.plot))
    if args.json:
        dump_json(result, sys.stdout)  # the stdout of now (tests capture it)
    else:
        print_report(result)
    return 0


def replay(trace, policy: str, capacity_pages: int, page_tokens: int) -> dict:
    """Run the trace through a fresh store: lookup, then put the computed pages parents first."""
    store = PageStore(capacity_pages, PAGE_BYTES, policy=policy)
    data = bytes(PAGE_BYTES)
    hit_tokens = 0
    peak_orphans = 0
    for request in trace:
        keys = request.keys
        hits = store.lookup(keys)
        hit_tokens += hits * page_tokens
        parent = keys[hits - 1] if hits else b""
        for key in keys[hits:]:
            store.put(key, parent, data)
            parent = key
        peak_orphans = max(peak_orphans, store.num_orphans())
    store.check_invariants()
    return {"hit_tokens": hit_tokens, "orphans_end": store.num_orphans(), "orphans_peak": peak_orphans,
            "evictions": store.stats.evictions, "refused_puts": store.stats.refusals}


def print_report(result: dict) -> None:
    trace = result["trace"]
    kinds = ", ".join(f"{n} {kind}" for kind, n in trace["kinds"].items())
    print(f"trace: {trace['requests']} requests ({kinds}), seed {result['options']['seed']}, "
          f"{trace['prompt_tokens']} prompt tokens in pages of {trace['page_tokens']}, "
          f"working set {trace['working_set_pages']} pages")
    baseline = result["baseline"]
    rows = [[f"{r['capacity_percent']:g}%", r["capacity_pages"], r["policy"], r["hit_rate"],
             "-" if r["hit_rate_vs_baseline"] is None else r["hit_rate_vs_baseline"],
             r["orphans_end"], r["orphans_peak"], r["evictions"], r["refused_puts"]] for r in result["results"]]
    print_table(["capacity", "pages", "policy", "hit rate", f"vs {baseline}", "orphans end", "orphans peak",
                 "evictions", "refused puts"], rows, out=sys.stdout)
    if "charts" in result:
        print("charts: " + ", ".join(result["charts"]))
    print(f"({result['seconds']:.1f} s)")


def draw_charts(plt, results: list[dict], policies: list[str], folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    charts = []
    for field, label, name in [("hit_rate", "hit rate (prompt tokens usable as cached prefix)", "eviction_hit_rate.png"),
                               ("orphans_peak", "orphaned pages at their peak", "eviction_orphans.png")]:
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for policy in policies:
            mine = [r for r in results if r["policy"] == policy]
            axes.plot([r["capacity_percent"] for r in mine], [r[field] for r in mine], marker="o", label=policy)
        axes.set_xlabel("pool capacity, % of the working set")
        axes.set_ylabel(label)
        axes.grid(True, alpha=0.3)
        axes.legend()
        path = folder / name
        figure.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(figure)
        charts.append(str(path))
    return charts


def _parse_options(args: argparse.Namespace) -> tuple[list[float], list[str]]:
    if not 1 <= args.requests <= MAX_REQUESTS:
        raise ValueError(f"--requests must be between 1 and {MAX_REQUESTS}, got {args.requests}")
    try:
        capacities = [float(part) for part in args.capacities.split(",")]
    except ValueError:
        raise ValueError(f"--capacities takes comma-separated percentages, got {args.capacities!r}") from None
    if not all(0 < c <= 100 for c in capacities):
        raise ValueError(f"--capacities must each be above 0 and at most 100, got {args.capacities!r}")
    policies = [ALIASES.get(part.strip(), part.strip()) for part in args.policies.split(",")]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or len(set(policies)) != len(policies):
        raise ValueError(f"--policies takes distinct names from {', '.join(POLICIES)}, got {args.policies!r}")
    return sorted(set(capacities)), policies
