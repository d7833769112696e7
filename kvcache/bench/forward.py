"""`kvcache bench forward`: the CPU time of one forward of the last few tokens of a long
context, the step a warm run makes after its cached pages (bench remote's warm-local: the
last 16 tokens of 1,024 over 63 cached pages). Thread CPU is shown beside wall time: on a
machine shared with other work it moves far less than the wall clock, so it is the figure
to compare across code changes. Row counts take turns, so they share the same minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np

from base.pages import KV_DTYPES
from kvcache.bench.report import dump_json, machine, print_table

PREFILL_CHUNK = 128   # the context is written as the engine's default prefill chunks would write it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from worker.model.named import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"a model name, .gguf file or folder (default {DEFAULT_MODEL})")
    parser.add_argument("--context", type=int, default=1024, help="tokens of context after the step (default 1024)")
    parser.add_argument("--rows", default="16", help="comma-separated counts of new tokens per forward (default 16)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="float16", help="KV dtype, of the pool too (default float16)")
    parser.add_argument("--threads", type=int, default=None,
                        help="BLAS threads for every timed forward (default: what the engine picks for its rows)")
    parser.add_argument("--repeats", type=int, default=20, help="forwards timed per row count; medians shown (default 20)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    from worker.kv.quant import storage_dtype
    from worker.model import ForwardBatch, kv_block_shape, load_model
    from worker.model.blas import forced_threads

    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1 or args.repeats < 1 or (args.threads is not None and args.threads < 1):
        print("kvcache bench forward: error: --rows must be positive integers separated by commas, and --repeats "
              "and --threads positive", file=sys.stderr)
        return 2
    try:
        model = load_model(args.model)
    except ValueError as exc:
        print(f"kvcache bench forward: error: {exc}", file=sys.stderr)
        return 2
    c = model.config
    if not max(rows) < args.context <= c.max_positions:
        print(f"kvcache bench forward: error: --context {args.context} must exceed every --rows and be at most the "
              f"model's {c.max_positions} positions", file=sys.stderr)
        return 2
    page = 16
    blocks = -(-args.context // page)
    # In the KV dtype, as the engine keeps it (a float16 pool is converted as attention reads it).
    pool = np.zeros((blocks, *kv_block_shape(c, args.kv_dtype, page)), dtype=storage_dtype(args.kv_dtype))
    table = np.arange(blocks)
    tokens = np.random.default_rng(0).integers(0, c.vocab_size, args.context)

    def batch(lo: int, hi: int) -> ForwardBatch:
        return ForwardBatch(tokens[lo:hi], np.arange(lo, hi), np.array([0, hi - lo]), np.array([hi]), [table])

    for lo in range(0, args.context - min(rows), PREFILL_CHUNK):
        model.forward(batch(lo, min(lo + PREFILL_CHUNK, args.context - min(rows))), pool, args.kv_dtype)
    samples = {n: {"thread_cpu": [], "process_cpu": [], "wall": []} for n in rows}
    with forced_threads(args.threads) if args.threads is not None else contextlib.nullcontext():
        for n in rows:   # once untimed: first-call costs
            model.forward(batch(args.context - n, args.context), pool, args.kv_dtype)
        for _ in range(args.repeats):
            for n in rows:
                t, p, w = time.thread_time(), time.process_time(), time.perf_counter()
                model.forward(batch(args.context - n, args.context), pool, args.kv_dtype)
                s = samples[n]
                s["thread_cpu"].append((time.thread_time() - t) * 1e3)
                s["process_cpu"].append((time.process_time() - p) * 1e3)
                s["wall"].append((time.perf_counter() - w) * 1e3)
    result = {
        "model": args.model, "context": args.context, "kv_dtype": args.kv_dtype, "repeats": args.repeats,
        "blas_threads": args.threads if args.threads is not None else "engine",
        "load_average": list(os.getloadavg()), "machine": machine(),
        "ms": {str(n): {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()},
        "min_ms": {str(n): {k: min(v) for k, v in s.items()} for n, s in samples.items()},
    }
    if args.json:
        dump_json(result)
        return 0
    threads = "the engine's choice" if args.threads is None else str(args.threads)
    print(f"{args.model}: forward of the last n tokens of {args.context}, {args.kv_dtype} KV, BLAS threads: "
          f"{threads}; medians of {args.repeats} (load average {result['load_average'][0]:.1f})")
    print_table(["rows", "thread CPU ms", "process CPU ms", "wall ms", "min thread CPU ms"],
                [[n, result["ms"][str(n)]["thread_cpu"], result["ms"][str(n)]["process_cpu"],
                  result["ms"][str(n)]["wall"], result["min_ms"][str(n)]["thread_cpu"]] for n in rows])
    return 0
