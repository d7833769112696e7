"""What `kvcache bench load` prints and draws: each figure with the cache, without it, and the gain."""

from __future__ import annotations

import math
from pathlib import Path

from kvcache.bench.report import print_table, pyplot


def print_report(result: dict) -> None:
    o, c = result["options"], result["cluster"]
    where = "a local cluster started here" if c["started_here"] else "the cluster at " + ",".join(c["coordinators"])
    print(f"load bench: {where}: {len(c['nodes'])} kvnodes, {len(c['workers'])} workers, model {c['model']}; "
          f"{o['requests']} requests per pass, {o['max_tokens']} tokens each, seed {o['seed']}")
    print(f"order: {result['order']}")
    for level in result["levels"]:
        print()
        _print_level(level)
    if len(result["levels"]) > 1:
        print()
        print_table(["clients", "req/s cache", "req/s no cache", "tok/s cache", "tok/s no cache", "TTFT p50 gain"], [
            [lv["concurrency"], _s(lv, "cache")["requests_per_s"], _s(lv, "no_cache")["requests_per_s"],
             _s(lv, "cache")["generated_tokens_per_s"], _s(lv, "no_cache")["generated_tokens_per_s"],
             _x(lv["gains"]["ttft_p50"])]
            for lv in result["levels"]
        ])
    if "gateway_paired" in result:
        p = result["gateway_paired"]
        print(f"\nwhat the gateway adds, in {p['pairs']} pairs of back-to-back requests (one cached prompt, gRPC "
              f"and HTTP): TTFT p50 {p['http_ttft_p50_ms']:.1f} ms through HTTP, {p['grpc_ttft_p50_ms']:.1f} ms over "
              f"gRPC; median added {p['added_ms_p50']:+.1f} ms (goal under {p['goal_ms']:g} ms: "
              f"{'met' if p['goal_met'] else 'NOT met'})")
    for path in result.get("plots", []):
        print(f"chart: {path}")


def _print_level(level: dict) -> None:
    cache, base, g = _s(level, "cache"), _s(level, "no_cache"), level["gains"]
    kinds = ", ".join(f"{n} {k}" for k, n in level["requests_by_kind"].items())
    print(f"{level['concurrency']} concurrent clients; workload: {kinds} ({level['families']} prompt families)")
    rows = [
        ["requests completed (failed)", f"{cache['requests']} ({cache['failed']})", f"{base['requests']} ({base['failed']})", ""],
        ["requests/s", cache["requests_per_s"], base["requests_per_s"], _x(g["requests_per_s"])],
        ["generated tokens/s", cache["generated_tokens_per_s"], base["generated_tokens_per_s"],
         _x(g["generated_tokens_per_s"])],
    ]
    rows += [[f"time to first token {p} ms", cache["ttft_ms"][p], base["ttft_ms"][p], _x(g[f"ttft_{p}"])]
             for p in cache["ttft_ms"]]
    rows += [[f"end-to-end latency {p} ms", cache["latency_ms"][p], base["latency_ms"][p], _x(g[f"latency_{p}"])]
             for p in cache["latency_ms"]]
    for label, key in (("prompt tokens from cache, all", "cache"), ("prompt tokens from cache, once warm", "cache_once_warm")):
        rows.append([label, _share(cache[key]), _share(base[key]), ""])
    for kind, shares in cache["cache_by_kind"].items():
        rows.append([f"  of which {kind} requests", _share(shares), _share(base["cache_by_kind"].get(kind, {})), ""])
    evicted_base = sum(n["evictions"] for n in level["passes"]["no_cache"]["nodes"].values())
    rows.append(["pages evicted (kvnodes)", level["pages_evicted"], evicted_base, ""])
    print_table(["measure", "cache", "no cache", "gain"], rows)

    if "gateway" in level:
        g_ = level["gateway"]
        print(f"through the gateway (HTTP, cache on): TTFT p50 {g_['ttft_p50_ms']:.1f} ms against "
              f"{g_['grpc_ttft_p50_ms']:.1f} ms over gRPC in the cache pass ({g_['ttft_p50_added_ms']:+.1f} ms, "
              f"passes a minute apart); {g_['requests_per_s']:.2f} requests/s against {g_['grpc_requests_per_s']:.2f}")
    met = level["goals_met"]
    interval = level["ttft_p50_gain_interval"]
    print(f"TTFT p50 gain {_x(g['ttft_p50'])}: {_x(interval['low'])}..{_x(interval['high'])} in {interval['level']:.0%} "
          f"of bootstrap redraws of each pass's requests (how much it owes to which requests ran)")
    print(f"goal TTFT p50 >= 5x lower with the cache: {_x(g['ttft_p50'])} ({'met' if met['ttft_p50_gain'] else 'NOT met'}); "
          f"goal >= 80% of prompt tokens from cache once warm: {cache['cache_once_warm']['total']:.0%} "
          f"({'met' if met['cached_share_once_warm'] else 'NOT met'})")
    print()
    nodes = level["passes"]["cache"]["nodes"]
    print_table(["kvnode (cache pass)", "lookups", "hit pages", "miss pages", "pages sent", "pages stored", "evicted",
                 "MiB in", "MiB out"],
                [[a, n["lookups"], n["hit_pages"], n["miss_pages"], n["get_pages"], n["stored_pages"], n["evictions"],
                  n["bytes_in"] / 2**20, n["bytes_out"] / 2**20] for a, n in nodes.items()])
    print()
    workers_cache, workers_base = level["passes"]["cache"]["workers"], level["passes"]["no_cache"]["workers"]
    print_table(["worker", "in flight mean (cache / no cache)", "peak", "busy share"],
                [[a, f"{w['mean_in_flight']:.2f} / {workers_base[a]['mean_in_flight']:.2f}",
                  f"{w['peak_in_flight']} / {workers_base[a]['peak_in_flight']}",
                  f"{w['busy_share']:.0%} / {workers_base[a]['busy_share']:.0%}"] for a, w in workers_cache.items()])


def plot_charts(result: dict, directory: Path) -> list[str]:
    """TTFT distribution with and without cache (per level); throughput against concurrency when several levels."""
    plt = pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for level in result["levels"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, label in (("no_cache", "no cache"), ("cache", "cache")):
            values = sorted(level["passes"][name]["ttft_ms_all"])
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (ms, log scale)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"TTFT with and without the cache, {level['concurrency']} clients ({result['cluster']['model']})")
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = directory / f"load_ttft_c{level['concurrency']}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(str(path))
    if len(result["levels"]) > 1:
        levels = [lv["concurrency"] for lv in result["levels"]]
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for name, label in (("cache", "cache"), ("no_cache", "no cache")):
            left.plot(levels, [_s(lv, name)["requests_per_s"] for lv in result["levels"]], marker="o", label=label)
            right.plot(levels, [_s(lv, name)["generated_tokens_per_s"] for lv in result["levels"]], marker="o",
                       label=label)
        for ax, what in ((left, "requests/s"), (right, "generated tokens/s")):
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(what)
            ax.set_xticks(levels)
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle("Throughput against concurrency")
        path = directory / "load_throughput.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(str(path))
    return paths


def _s(level: dict, name: str) -> dict:
    return level["passes"][name]["summary"]


def _x(value: float) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.2f}x"


def _share(shares: dict) -> str:
    if not shares or not shares.get("prompt_tokens"):
        return "-"
    return f"{shares['total']:.0%} (local {shares['local']:.0%}, kvnodes {shares['remote']:.0%})"
