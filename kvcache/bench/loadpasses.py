"""The load bench's passes over a running cluster (no cache, cache, through the gateway) and
what it learns of the cluster first; `kvcache bench load` and its observability-cost run both
run them."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

from coordinator.client import Client
from kvcache.bench import workload as wl
from kvcache.bench.loadoptions import check_positions
from kvcache.bench.loadrun import PassRun, paired_ttft, run_pass, warm_up
from kvcache.bench.loadreport import plot_charts, print_report
from kvcache.bench.report import dump_json, machine, versions
from kvcache.bench.stats import gain, gain_interval, summarize_pass
from kvcache.cluster import default_blas_threads
from worker.model.tokenizer import Tokenizer

TTFT_GOAL = 5.0
GATEWAY_TTFT_GOAL_MS = 5.0
WARM_SHARE_GOAL = 0.80


def bench_passes(args, config: wl.WorkloadConfig, levels: list[int], coordinators: list[str], tokenizer: Tokenizer,
           gateway: str | None = None, quiet_json: bool = False) -> dict:
    members = cluster_members(coordinators)
    check_positions(config, args, members["worker_limits"])
    if members["model"] != (Path(args.model).name or args.model):
        raise ValueError(f"the cluster's workers run {members['model']}, not --model {args.model}: give the model "
                         "they run (session turns are sent as its token ids)")
    run_id = uuid.uuid4().hex[:6]
    warmup = args.warmup if args.warmup is not None else 2 * len(members["workers"])
    say = (lambda *a: None) if args.json or args.no_progress else (lambda m: print(m, file=sys.stderr, flush=True))
    say(f"cluster: {len(members['nodes'])} kvnodes, {len(members['workers'])} workers, model {members['model']}")
    warm_up(coordinators, warmup, args.max_tokens, run_id)
    result = {
        "bench": "load",
        "machine": machine(),
        "versions": versions(),
        "options": {k: v for k, v in vars(args).items() if k != "run"},
        "workload": {**config.__dict__, "mix": list(config.mix)},
        "cluster": {"started_here": args.coordinators is None, "coordinators": coordinators,
                    "blas_threads_per_worker": blas_threads(args) if args.coordinators is None else None,
                    "nodes": members["nodes"], "workers": members["workers"], "model": members["model"],
                    "gateway": gateway},
        "order": f"{warmup} uncached warm-up requests (not counted), then per concurrency level the no-cache "
                 "pass, then the cache pass (which starts cold: the no-cache pass writes nothing)",
        "goals": {"ttft_p50_gain": TTFT_GOAL, "cached_share_once_warm": WARM_SHARE_GOAL},
        "levels": [],
    }
    for level in levels:
        tag = f"{run_id}.{level} "  # short: a family's number must fall in the first page
        jobs = wl.build_workload(config, tag)
        passes = {}
        for name, no_cache in (("no_cache", True), ("cache", False)):
            run_ = PassRun(coordinators, members["nodes"], members["workers"], level, no_cache, args.max_tokens,
                           args.duration, tokenizer, progress=not (args.json or args.no_progress))
            results, wall_s, nodes, workers = run_pass(run_, jobs, f"{name.replace('_', '-')} pass, {level} clients")
            passes[name] = {"summary": summarize_pass(results, wall_s), "nodes": nodes, "workers": workers,
                            "ttft_ms_all": [round(r.ttft_ms, 3) for r in results if r.ok]}
        if gateway:
            gateway_jobs = wl.build_workload(config, f"{run_id}.{level}h ")
            run_ = PassRun(coordinators, members["nodes"], members["workers"], level, False, args.max_tokens,
                           args.duration, tokenizer, progress=not (args.json or args.no_progress), gateway=gateway,
                           model=members["model"])
            results, wall_s, nodes, workers = run_pass(run_, gateway_jobs, f"gateway pass, {level} clients")
            passes["gateway"] = {"summary": summarize_pass(results, wall_s), "nodes": nodes, "workers": workers,
                                 "ttft_ms_all": [round(r.ttft_ms, 3) for r in results if r.ok]}
        result["levels"].append(level_result(level, tag, jobs, passes))
    if gateway:
        prompt = f"{run_id} paired: " + "the same question over gRPC and over HTTP, one after the other. " * 3
        paired = paired_ttft(coordinators, gateway, members["model"], prompt, args.gateway_pairs, args.max_tokens)
        result["gateway_paired"] = {**paired, "goal_ms": GATEWAY_TTFT_GOAL_MS,
                                    "goal_met": paired["added_ms_p50"] < GATEWAY_TTFT_GOAL_MS}
    if args.plot:
        result["plots"] = plot_charts(result, Path(args.plot))
    if not args.json:
        print_report(result)
    elif not quiet_json:
        dump_json(result)
    return result


def level_result(level: int, tag: str, jobs: list[wl.Job], passes: dict) -> dict:
    requests = wl.all_requests(jobs)
    cache, base = passes["cache"]["summary"], passes["no_cache"]["summary"]
    gains = {
        "requests_per_s": gain(cache["requests_per_s"], base["requests_per_s"], False),
        "generated_tokens_per_s": gain(cache["generated_tokens_per_s"], base["generated_tokens_per_s"], False),
        **{f"ttft_{p}": gain(cache["ttft_ms"][p], base["ttft_ms"][p], True) for p in cache["ttft_ms"]},
        **{f"latency_{p}": gain(cache["latency_ms"][p], base["latency_ms"][p], True) for p in cache["latency_ms"]},
    }
    evicted = sum(n["evictions"] for n in passes["cache"]["nodes"].values())
    through_gateway = None
    if "gateway" in passes:
        http = passes["gateway"]["summary"]
        added = http["ttft_ms"]["p50"] - cache["ttft_ms"]["p50"]
        through_gateway = {"ttft_p50_ms": http["ttft_ms"]["p50"], "grpc_ttft_p50_ms": cache["ttft_ms"]["p50"],
                           "ttft_p50_added_ms": added,
                           "requests_per_s": http["requests_per_s"], "grpc_requests_per_s": cache["requests_per_s"]}
    interval = gain_interval(passes["cache"]["ttft_ms_all"], passes["no_cache"]["ttft_ms_all"])
    return {
        "concurrency": level,
        "tag": tag,
        "requests_by_kind": {k: sum(r.kind == k for r in requests) for k in wl.KINDS},
        "families": len({r.family for r in requests}),
        "passes": passes,
        "gains": gains,
        "ttft_p50_gain_interval": {"level": 0.9, "low": interval[0], "high": interval[1]},
        "pages_evicted": evicted,
        **({"gateway": through_gateway} if through_gateway else {}),
        "goals_met": {"ttft_p50_gain": gains["ttft_p50"] >= TTFT_GOAL,
                      "cached_share_once_warm": cache["cache_once_warm"]["total"] >= WARM_SHARE_GOAL},
    }


def blas_threads(args) -> int:
    return args.blas_threads or default_blas_threads(args.workers)


def cluster_members(coordinators: list[str]) -> dict:
    from worker.client import WorkerClient

    with Client(coordinators) as client:
        status = client.status()
    alive = [m for m in status.members if m.alive]
    nodes = sorted(m.address for m in alive if m.role == "node")
    workers = sorted(m.address for m in alive if m.role == "worker")
    if not workers:
        raise RuntimeError("the cluster has no live worker")
    limits = []
    for address in workers:
        with WorkerClient(address) as worker:
            info = worker.info()
        limits.append((info.max_positions, info.max_tokens_limit))
    models = sorted({m.model for m in alive if m.role == "worker"})
    return {"nodes": nodes, "workers": workers, "model": ",".join(models), "worker_limits": limits}
