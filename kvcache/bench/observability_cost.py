"""`kvcache bench load --observability-cost`: what metrics and tracing cost, on and off in one run.

Two local clusters of the same shape run side by side: "off" as `cluster up --no-metrics` would
start it, "on" with every member serving --metrics-port (scraped every --scrape-interval seconds while it
runs, default 1, more often than Prometheus' usual 15-30 s) and exporting trace spans over OTLP (--otlp-endpoint) to a
sink that reads each export and answers it, as a collector would; scraper and sink run in
processes of their own (watchers.py), not on the bench's GIL. The load bench's
passes (no cache, then cache, on a fresh workload tag each time) alternate between them: off, on,
off, on, ... --repeat pairs. Each pair gives the ratio of throughput on/off for each pass, and the
median of the pairs is the figure, with every pair printed so the machine's noise can be seen;
the load average before each arm is printed beside it. Beside throughput, the CPU time the
members' processes used per request (from /proc) in each arm: on a machine shared with other
work it moves far less than wall-clock throughput, and it is what metrics and tracing add. Without the `otel` extra the "on" arm
runs metrics alone and says so. With it, the sink counts the spans it received by service and
name, printed per request of the on arm: where tracing's cost goes (--trace-sample-ratio R
traces that share of the requests).

The idle cluster is not scraped and exports nothing while the other runs (heartbeats make no
span); its heartbeats (one a second per member) are all it costs the other.

--side-by-side runs each pair's arms at the same time instead, each pass on both clusters at
once for --duration seconds (give more --requests than that can serve): whatever else the machine
does then falls on both arms alike, which taking turns cannot promise. Each arm's throughput is
counted over the window both were busy (until the earlier of --duration and either arm's last
start), a request still running at its end counted by the share of its time inside the window,
so a few requests more or less do not decide the ratio. What the "on" arm does on its request
threads shows in the ratio; what it does on other threads (answering scrapes, exporting spans)
takes CPU from both arms alike, so the ratio counts only part of that: the members' CPU time
per request, printed beside, counts all of it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from kvcache.bench import workload as wl
from kvcache.bench.loadoptions import check_positions
from kvcache.bench.loadpasses import bench_passes, blas_threads, cluster_members
from kvcache.bench.loadrun import PassRun, run_pass, warm_up
from kvcache.bench.report import dump_json, machine, versions
from kvcache.bench.stats import summarize_pass
from kvcache.bench.watchers import Scraper, SpanSink

ARMS = ("off", "on")
PASSES = ("no_cache", "cache")
GOAL = 0.02  # at most this share of throughput lost with metrics and tracing on
EXPORT_DELAY_S = 6.0  # the SDK's batch processor exports every 5 s (OTEL_BSP_SCHEDULE_DELAY)
SERVICE_ROLES = {"kvcache-coordinator": "coordinator", "kvcache-node": "node", "kvcache-worker": "worker"}


def tracing_available() -> bool:
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


def cpu_seconds(daemons) -> dict[str, float]:
    """User and system CPU seconds each role's processes have used (Linux /proc), threads included."""
    ticks = os.sysconf("SC_CLK_TCK")
    total: dict[str, float] = {}
    for daemon in daemons:
        try:
            fields = Path(f"/proc/{daemon.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total[daemon.role] = total.get(daemon.role, 0.0) + (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total

def run(args: argparse.Namespace, config, levels: list[int], tokenizer) -> int:
    from kvcache.cluster import start_cluster, wait_healthy

    say = (lambda m: None) if args.no_progress else (lambda m: print(m, file=sys.stderr, flush=True))
    tracing = tracing_available()
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="kvcache-bench-cost-"))
    quiet = argparse.Namespace(**{**vars(args), "json": True, "no_progress": True, "plot": None})
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(SpanSink()) if tracing else None
        clusters = {}
        for arm in ARMS:
            say(f"starting the '{arm}' cluster ({args.nodes} kvnodes, {args.workers} workers, model {args.model}); "
                f"logs in {logs / arm}")
            clusters[arm] = stack.enter_context(start_cluster(
                logs / arm, nodes=args.nodes, workers=args.workers, coordinators=2, replicas=args.replicas,
                model=args.model, kv_dtype=args.kv_dtype, node_capacity=args.node_capacity,
                worker_kv_cache=args.worker_kv_cache, blas_threads=blas_threads(args),
                max_prefill_tokens=args.max_prefill_tokens, alone_prefill_tokens=args.alone_prefill_tokens,
                metrics=arm == "on",
                otlp_endpoint=sink.url if arm == "on" and sink is not None else None,
                trace_sample_ratio=args.trace_sample_ratio))
        for cluster in clusters.values():
            wait_healthy(cluster.coordinator_addresses, args.nodes, args.workers, timeout_s=180.0)
        pairs = []
        if args.side_by_side:
            for cluster in clusters.values():
                _warm_up(cluster, args, config)
        for number in range(args.repeat):
            if args.side_by_side:
                pairs.append(_side_by_side_pair(clusters, args, config, levels, tokenizer, number, say))
                continue
            pair = {}
            for arm in ARMS:
                load = os.getloadavg()[0]
                cpu_before = cpu_seconds(clusters[arm].daemons)
                scraper = (Scraper([d.metrics_url for d in clusters[arm].daemons], args.scrape_interval).start()
                           if arm == "on" else None)
                try:
                    result = bench_passes(quiet, config, levels, clusters[arm].coordinator_addresses, tokenizer,
                                    quiet_json=True)
                finally:
                    if scraper is not None:
                        scraper.stop()
                requests = sum(level["passes"][p]["summary"]["requests"] for level in result["levels"] for p in PASSES)
                pair[arm] = {"load_average": load, "requests": requests, "levels": [
                    {p: level["passes"][p]["summary"] for p in PASSES} for level in result["levels"]],
                    "cpu_ms_per_request_by_role": {
                        role: round((seconds - cpu_before.get(role, 0.0)) * 1000 / max(1, requests), 2)
                        for role, seconds in cpu_seconds(clusters[arm].daemons).items()}}
                pair[arm]["cpu_ms_per_request"] = sum(pair[arm]["cpu_ms_per_request_by_role"].values())
                say(f"pair {number + 1}/{args.repeat} {arm}: " + "; ".join(
                    f"{lv} clients " + ", ".join(f"{p.replace('_', '-')} {s[p]['requests_per_s']:.2f} req/s"
                                                 for p in PASSES)
                    for lv, s in zip(levels, pair[arm]["levels"])) + f" (load average {load:.1f})")
            pairs.append(pair)
        spans = None
        if sink is not None:  # before the sink stops, once the last batch had time to be exported
            time.sleep(EXPORT_DELAY_S)
            on_requests = sum(pair["on"]["requests"] for pair in pairs)
            spans = {"exports": sink.exports, "bytes": sink.bytes,
                     "per_request": _per_request(sink.spans(), on_requests)}
    report = _report(pairs, levels, tracing, spans, args.scrape_interval, args.trace_sample_ratio,
                     args.side_by_side)
    if args.json:
        dump_json({"bench": "load-observability-cost", "machine": machine(), "versions": versions(),
                   "options": {k: v for k, v in vars(args).items() if k != "run"}, **report})
    else:
        _print(report, levels)
    return 0


def _warm_up(cluster, args, config) -> None:
    warm_up(cluster.coordinator_addresses, args.warmup if args.warmup is not None else 2 * args.workers,
            args.max_tokens, uuid.uuid4().hex[:6])


def _side_by_side_pair(clusters: dict, args: argparse.Namespace, config, levels: list[int], tokenizer,
                       number: int, say) -> dict:
    """One pair with both arms at once: each pass starts on both clusters together (the same
    prompts, a fresh tag each pair so no pass finds an earlier pair's pages)."""

    members = {arm: cluster_members(clusters[arm].coordinator_addresses) for arm in ARMS}
    for arm in ARMS:
        check_positions(config, args, members[arm]["worker_limits"])
    run_id = uuid.uuid4().hex[:6]
    load = os.getloadavg()[0]
    cpu_before = {arm: cpu_seconds(clusters[arm].daemons) for arm in ARMS}
    pair = {arm: {"load_average": load, "requests": 0, "levels": []} for arm in ARMS}
    scraper = Scraper([d.metrics_url for d in clusters["on"].daemons], args.scrape_interval).start()
    try:
        for level in levels:
            jobs = wl.build_workload(config, f"{run_id}.{level} ")
            summaries = {arm: {} for arm in ARMS}
            for name, no_cache in (("no_cache", True), ("cache", False)):
                runs = {arm: PassRun(clusters[arm].coordinator_addresses, members[arm]["nodes"],
                                     members[arm]["workers"], level, no_cache, args.max_tokens, args.duration,
                                     tokenizer, progress=False) for arm in ARMS}
                started: dict[str, float] = {}

                def timed(arm: str):
                    started[arm] = time.monotonic()
                    return run_pass(runs[arm], jobs, name)

                outcomes = _at_once({arm: (lambda a=arm: timed(a)) for arm in ARMS})
                window = min([args.duration] + [max((r.start_s for r in results), default=0.0)
                                                for results, *_ in outcomes.values()])
                if window <= 0:
                    raise RuntimeError(f"the {name.replace('_', '-')} pass left an arm without a request after the "
                                       "first: give more --requests (and see the clusters' logs, --logs DIR)")
                for arm, (results, wall_s, _, _) in outcomes.items():
                    summary = summarize_pass(results, wall_s)
                    summary["requests_per_s"] = requests_in_window(results, window) / window if window > 0 else 0.0
                    summary["window_s"] = window
                    summary["arms_started_apart_s"] = round(max(started.values()) - min(started.values()), 4)
                    summaries[arm][name] = summary
                    pair[arm]["requests"] += summary["requests"]
            for arm in ARMS:
                pair[arm]["levels"].append(summaries[arm])
                say(f"pair {number + 1}/{args.repeat} {arm}: {level} clients " + ", ".join(
                    f"{p.replace('_', '-')} {summaries[arm][p]['requests_per_s']:.2f} req/s"
                    for p in PASSES) + f" (side by side, load average {load:.1f})")
    finally:
        scraper.stop()
    for arm in ARMS:
        pair[arm]["cpu_ms_per_request_by_role"] = {
            role: round((seconds - cpu_before[arm].get(role, 0.0)) * 1000 / max(1, pair[arm]["requests"]), 2)
            for role, seconds in cpu_seconds(clusters[arm].daemons).items()}
        pair[arm]["cpu_ms_per_request"] = sum(pair[arm]["cpu_ms_per_request_by_role"].values())
    return pair


def _at_once(calls: dict) -> dict:
    """Run each call on a thread of its own, all released together; their results by name."""
    barrier = threading.Barrier(len(calls))
    results, errors = {}, {}

    def run(name, call):
        try:
            barrier.wait(60.0)
            results[name] = call()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, on the caller's thread
            errors[name] = exc

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise next(iter(errors.values()))
    return results


def requests_in_window(results, window_s: float) -> float:
    """Requests completed within [0, window_s] of their pass, one still running at its end
    counted by the share of its time inside (failed ones not at all)."""
    done = 0.0
    for r in results:
        if not r.ok or r.start_s >= window_s:
            continue
        if r.end_s <= window_s:
            done += 1.0
        else:
            done += (window_s - r.start_s) / (r.end_s - r.start_s)
    return done


def _per_request(spans: dict[str, dict[str, int]] | None, requests: int) -> dict[str, dict[str, float]] | None:
    """Spans the "on" cluster exported per request of its arms, by role and span name; spans made
    while it sat idle count too, as part of what tracing costs."""
    if spans is None:
        return None
    return {SERVICE_ROLES.get(service, service): {name: round(count / max(1, requests), 2)
                                                   for name, count in sorted(names.items())}
            for service, names in sorted(spans.items())}


def _report(pairs: list[dict], levels: list[int], tracing: bool, spans: dict | None,
            scrape_interval: float = 1.0, sample_ratio: float | None = None, side_by_side: bool = False) -> dict:
    summary = []
    for index, level in enumerate(levels):
        ratios = {p: [pair["on"]["levels"][index][p]["requests_per_s"] /
                      pair["off"]["levels"][index][p]["requests_per_s"] for pair in pairs] for p in PASSES}
        medians = {p: statistics.median(r) for p, r in ratios.items()}
        summary.append({"concurrency": level, "ratios_on_off": ratios, "median": medians,
                        "goal_met": {p: m >= 1 - GOAL for p, m in medians.items()}})
    cpu = [pair["on"]["cpu_ms_per_request"] / pair["off"]["cpu_ms_per_request"] for pair in pairs]
    return {"arms": {"off": "no --metrics-port, no tracing",
                     "on": f"--metrics-port scraped every {scrape_interval:g} s" + (
                         f", spans of {1.0 if sample_ratio is None else sample_ratio:g} of the requests over OTLP "
                         "to a sink" if tracing else "; tracing not measured (no otel extra)")},
            "order": ("side by side: each pass on both clusters at once, throughput over the window both were busy"
                      if side_by_side else "taking turns: off, then on, each pair"),
            "tracing_measured": tracing, "spans_exported": spans, "pairs": pairs, "summary": summary,
            "cpu_per_request_on_off": {"ratios": cpu, "median": statistics.median(cpu)}, "goal": GOAL}


def _print(report: dict, levels: list[int]) -> None:
    print(f"on: {report['arms']['on']}; off: {report['arms']['off']}; {report['order']}")
    if report["spans_exported"]:
        s = report["spans_exported"]
        print(f"spans: {s['exports']} OTLP exports, {s['bytes'] / 1e6:.1f} MB")
        for role, names in (s.get("per_request") or {}).items():
            print(f"  {role}: {sum(names.values()):.1f} spans a request (" +
                  ", ".join(f"{name} {count:g}" for name, count in names.items()) + ")")
    for index, level in enumerate(report["summary"]):
        print(f"{level['concurrency']} clients: throughput on / off (requests/s)")
        for number, pair in enumerate(report["pairs"]):
            cells = []
            for p in PASSES:
                off, on = (pair[arm]["levels"][index][p]["requests_per_s"] for arm in ARMS)
                cells.append(f"{p.replace('_', '-')} {on:.2f}/{off:.2f} = {on / off:.3f}")
            print(f"  pair {number + 1}: " + "  ".join(cells) +
                  f"  (load average {pair['off']['load_average']:.1f}, {pair['on']['load_average']:.1f})")
        m = level["median"]
        print("  median: " + "  ".join(
            f"{p.replace('_', '-')} {m[p]:.3f} ({(1 - m[p]) * 100:+.1f}% cost, goal under {report['goal'] * 100:.0f}%"
            f"{': met' if level['goal_met'][p] else ': not met'})" for p in PASSES))
    cpu = report["cpu_per_request_on_off"]
    print("the members' CPU time per request (every pass and level), on / off (the machine's other work "
          "moves it less than throughput)")
    for number, (pair, ratio) in enumerate(zip(report["pairs"], cpu["ratios"]), 1):
        print(f"  pair {number}: {pair['on']['cpu_ms_per_request']:.1f}/{pair['off']['cpu_ms_per_request']:.1f} ms "
              f"= {ratio:.3f}")
    print(f"  median: {cpu['median']:.3f} ({(cpu['median'] - 1) * 100:+.1f}% CPU); by role, ms per request on / off, "
          f"median of the pairs: " + ", ".join(
              f"{role} {statistics.median(p['on']['cpu_ms_per_request_by_role'][role] for p in report['pairs']):.1f}/"
              f"{statistics.median(p['off']['cpu_ms_per_request_by_role'][role] for p in report['pairs']):.1f}"
              for role in report["pairs"][0]["off"]["cpu_ms_per_request_by_role"]))
