"""The options of `kvcache bench load` and their checks: the workload they describe and the
concurrency levels, a ValueError before any cluster starts for what cannot run."""

from __future__ import annotations

import argparse

from base.pages import KV_DTYPES
from kvcache.bench import workload as wl


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = wl.WorkloadConfig()
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--coordinators", default=None, help="use a running cluster (A,B) instead of starting one")
    cluster.add_argument("--gateway", default=None, metavar="URL",
                         help="also drive the load through this `kvcache gateway` (http://HOST:PORT, in front of "
                              "the same cluster); `local` starts one in front of the local cluster")
    cluster.add_argument("--gateway-pairs", type=int, default=40, help="with --gateway: requests sent over each path "
                         "back to back to measure what the HTTP hop adds to TTFT (default 40)")
    cluster.add_argument("--model", default="gpt2-small-shape", help="tiny, gpt2-small-shape or a checkpoint folder "
                         "(default gpt2-small-shape; see the description); with --coordinators, the model the "
                         "cluster runs: session turns are sent as its token ids")
    cluster.add_argument("--nodes", type=int, default=3, help="kvnodes of the local cluster (default 3)")
    cluster.add_argument("--workers", type=int, default=2, help="workers of the local cluster (default 2)")
    cluster.add_argument("--replicas", type=int, default=2, help="kvnodes per sequence (default 2)")
    cluster.add_argument("--kv-dtype", choices=KV_DTYPES, default="float32", help="KV dtype (default float32)")
    cluster.add_argument("--node-capacity", default="512MiB", help="page pool per kvnode (default 512MiB)")
    cluster.add_argument("--worker-kv-cache", default="256MiB", help="local KV pool per worker (default 256MiB)")
    cluster.add_argument("--blas-threads", type=int, default=None, help="BLAS threads per worker of the local cluster "
                         "(default: cores / workers, at least 1; see the description)")
    cluster.add_argument("--max-prefill-tokens", type=int, default=None, help="prompt tokens a local worker "
                         "computes per step beside decodes, in chunks (default: the worker's, 128)")
    cluster.add_argument("--alone-prefill-tokens", type=int, default=None, help="prompt tokens a local worker "
                         "computes in a step with no decode, in chunks (default: the worker's, 512)")
    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", default="4", help="concurrent clients; a list such as 1,2,4 runs each level "
                      "(default 4)")
    load.add_argument("--requests", type=int, default=defaults.requests, help="requests per pass (default %(default)s)")
    load.add_argument("--duration", type=float, default=90.0, help="seconds per pass before no new request starts "
                      "(default 90)")
    load.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request, EOS ignored (default 8)")
    load.add_argument("--warmup", type=int, default=None, help="uncached warm-up requests (default 2 per worker)")
    load.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    load.add_argument("--repeat", type=int, default=1, help="run the passes N times on the same cluster, each on "
                      "fresh prompts, and print each run and the median gains (default 1)")
    mix = parser.add_argument_group("workload", "lengths are in characters (tokens for the byte-level presets)")
    mix.add_argument("--mix", default=_pair(defaults.mix), help="shares of shared-system-prompt, session and one-off "
                     f"requests (default {_pair(defaults.mix)})")
    mix.add_argument("--system-prompts", type=int, default=defaults.system_prompts, help="distinct system prompts (default %(default)s)")
    mix.add_argument("--zipf", type=float, default=defaults.zipf_s, help="popularity skew of the system prompts (default %(default)s)")
    mix.add_argument("--system-chars", type=int, default=defaults.system_chars, help="length of a system prompt (default %(default)s)")
    mix.add_argument("--question-chars", default=_pair(defaults.question_chars), help="question after it, MIN,MAX (default %(default)s)")
    mix.add_argument("--session-turns", type=int, default=defaults.session_turns, help="turns per session (default %(default)s)")
    mix.add_argument("--session-context-chars", type=int, default=defaults.session_context_chars,
                     help="a session's opening context (default %(default)s)")
    mix.add_argument("--turn-chars", default=_pair(defaults.turn_chars), help="user message per turn, MIN,MAX (default %(default)s)")
    mix.add_argument("--unique-chars", default=_pair(defaults.unique_chars), help="one-off prompt, MIN,MAX (default %(default)s)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    out.add_argument("--plot", metavar="DIR", default=None, help="write PNG charts into DIR (needs the bench extra)")
    out.add_argument("--logs", metavar="DIR", default=None, help="daemon logs of the local cluster (default: a temp dir)")
    out.add_argument("--step-logs", action="store_true", help="the local workers also write one JSON line per engine "
                     "step (requests, tokens, ms) to DIR/worker-N.steps.jsonl of --logs DIR: where each request's "
                     "time went")
    out.add_argument("--no-progress", action="store_true", help="no progress bar or lines on stderr")
    out.add_argument("--metrics", action="store_true", help="the local cluster's members serve --metrics-port and "
                     "every one is scraped once a second during the run (to measure what metrics cost)")
    out.add_argument("--scrape-interval", type=float, default=1.0,
                     help="seconds between scrapes of each member with --metrics or --observability-cost "
                          "(default 1; Prometheus' usual is 15-30)")
    out.add_argument("--observability-cost", action="store_true",
                     help="two local clusters, metrics and tracing off and on, the passes alternating between them "
                          "(off, on, ... --repeat pairs): prints each pair's throughput ratio and the median "
                          "(kvcache/bench/observability_cost.py)")
    out.add_argument("--side-by-side", action="store_true",
                     help="with --observability-cost: each pair's arms run at the same time, each pass on both "
                          "clusters for --duration seconds (give more --requests than that serves), so the "
                          "machine's other work falls on both alike")
    out.add_argument("--trace-sample-ratio", type=float, default=None, metavar="R",
                     help="with --observability-cost: the on cluster's daemons trace this share of requests "
                          "(their --trace-sample-ratio; default: every request)")



def check(args) -> tuple[wl.WorkloadConfig, list[int]]:
    levels = _ints(args.concurrency, "--concurrency")
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency needs positive counts such as 4 or 1,2,4, got {args.concurrency!r}")
    if args.blas_threads is not None and args.blas_threads < 1:
        raise ValueError(f"--blas-threads must be at least 1, got {args.blas_threads}")
    for name in ("requests", "max_tokens", "nodes", "workers", "replicas", "repeat"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.replicas > args.nodes:
        raise ValueError(f"--replicas {args.replicas} exceeds --nodes {args.nodes}")
    if args.duration <= 0:
        raise ValueError(f"--duration must be positive, got {args.duration}")
    for name in ("max_prefill_tokens", "alone_prefill_tokens"):
        flag, value = f"--{name.replace('_', '-')}", getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
        if value is not None and args.coordinators:
            raise ValueError(f"{flag} is for the local cluster; start a running cluster's workers with it")
    if args.observability_cost and (args.coordinators or args.gateway or args.metrics or args.plot):
        raise ValueError("--observability-cost starts its own two local clusters: give it without --coordinators, "
                         "--gateway, --metrics and --plot")
    if args.side_by_side and not args.observability_cost:
        raise ValueError("--side-by-side is for --observability-cost: it runs that bench's two clusters at once")
    if args.trace_sample_ratio is not None and not args.observability_cost:
        raise ValueError("--trace-sample-ratio is for --observability-cost's on cluster")
    if args.trace_sample_ratio is not None and not 0.0 <= args.trace_sample_ratio <= 1.0:
        raise ValueError(f"--trace-sample-ratio must be between 0 and 1, got {args.trace_sample_ratio}")
    if args.scrape_interval <= 0:
        raise ValueError(f"--scrape-interval must be positive, got {args.scrape_interval}")
    if args.step_logs and args.coordinators:
        raise ValueError("--step-logs is for the local cluster; start a running cluster's workers with --step-log FILE")
    if args.step_logs and not args.logs:
        raise ValueError("--step-logs needs --logs DIR, the folder the step logs go to")
    if args.gateway == "local" and args.coordinators:
        raise ValueError("--gateway local starts a gateway in front of the local cluster: with --coordinators, "
                         "give the URL of the running cluster's gateway")
    if args.gateway and args.gateway != "local":
        from kvcache.bench.gateway_client import GatewayClient

        GatewayClient(args.gateway, "")   # ValueError for a URL it cannot use
    if args.gateway_pairs < 1:
        raise ValueError(f"--gateway-pairs must be at least 1, got {args.gateway_pairs}")
    if args.warmup is not None and args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    mix = _floats(args.mix, "--mix")
    if len(mix) != 3:
        raise ValueError(f"--mix needs three shares (shared,session,unique), got {args.mix!r}")
    config = wl.WorkloadConfig(
        requests=args.requests, seed=args.seed, mix=tuple(mix), system_prompts=args.system_prompts,
        zipf_s=args.zipf, system_chars=args.system_chars, question_chars=_bounds(args.question_chars, "--question-chars"),
        session_turns=args.session_turns, session_context_chars=args.session_context_chars,
        turn_chars=_bounds(args.turn_chars, "--turn-chars"),
        unique_chars=_bounds(args.unique_chars, "--unique-chars"),
    )
    config.check()
    if args.coordinators is None:
        from kvcache.model_pages import model_page_bytes
        from base.units import parse_size

        model_page_bytes(args.model, args.kv_dtype)  # ValueError for an unknown model
        parse_size(args.node_capacity), parse_size(args.worker_kv_cache)
        from worker.model.config import PRESETS

        if args.model in PRESETS:
            check_positions(config, args, [(PRESETS[args.model].max_positions, None)])
    return config, sorted(set(levels))


def check_positions(config: wl.WorkloadConfig, args, limits) -> None:
    longest = config.longest_prompt_chars(args.max_tokens) + len("012345.1000 ")
    for max_positions, max_tokens_limit in limits:
        if longest + args.max_tokens > max_positions:
            raise ValueError(f"prompts of up to {longest} characters plus --max-tokens {args.max_tokens} may exceed "
                             f"the model's {max_positions} positions: shorten the prompts or sessions")
        if max_tokens_limit is not None and args.max_tokens > max_tokens_limit:
            raise ValueError(f"--max-tokens {args.max_tokens} exceeds the worker's limit {max_tokens_limit}")


def _ints(text: str, option: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{option} takes comma-separated integers, got {text!r}") from None


def _floats(text: str, option: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{option} takes comma-separated numbers, got {text!r}") from None


def _bounds(text: str, option: str) -> tuple[int, int]:
    values = _ints(text, option)
    if len(values) == 1:
        values *= 2
    if len(values) != 2:
        raise ValueError(f"{option} takes MIN,MAX (or one number), got {text!r}")
    return values[0], values[1]


def _pair(values) -> str:
    return ",".join(str(v) for v in values)
