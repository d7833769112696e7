"""Measure a part of the service. Each bench runs its baseline in the same invocation and prints ratios."""

from __future__ import annotations

import argparse

BENCHES = [
    ("node", "kvnode put/get throughput (data plane and gRPC) against a raw TCP socket"),
    ("transfer", "page get/put through a kvnode (data plane and gRPC), Redis and a raw TCP socket"),
    ("engine", "paged engine prefill/decode/TTFT against a dense runner"),
    ("remote", "TTFT cold vs warm from a kvnode vs warm local"),
    ("overlap", "a fill from a kvnode beside another request's forward, at once and one after the other"),
    ("forward", "CPU time of one forward of the last few tokens of a long context (a warm run's step)"),
    ("persistence", "the disk tier: fetch from disk vs RAM vs a plain file read; restart time with 1 GiB on disk"),
    ("eviction", "hit rate and orphans of the eviction policies against Belady's bound, on a trace (--trace) or generated"),
    ("ring", "the ring at 10-1,000 simulated kvnodes with churn: hit rate, keys moved, balance, placement cost"),
    ("load", "the cluster under concurrent load, with the cache and without"),
    ("chaos", "faults under load: failed and differing answers against an undisturbed run"),
    ("determinism", "one request resumed, chunked, batched, cached and fetched: logits bit for bit against it alone; what invariant numerics cost"),
    ("kv-dtype", "float32, float16, int8 and int4 KV: perplexity, pages per GiB, trace hit rate, fill, tokens/s"),
    ("versus-torch", "the engine's prefill and decode tokens/s beside transformers on PyTorch, the same weights"),
    ("vllm", "a vLLM engine's TTFT with its prompt's KV recomputed, from kvcache, or from vLLM's ExampleConnector"),
]


def add_arguments(parser: argparse.ArgumentParser, only: str | None = None) -> None:
    """Every bench's options; with `only`, that bench's alone (the others by name and help), so a
    bench does not import the code of all the others (kvcache.cli.build_parser)."""
    import importlib

    benches = parser.add_subparsers(dest="bench", metavar="BENCH")
    benches.required = True
    for name, summary in BENCHES:
        if only is not None and name != only:
            benches.add_parser(name, help=summary)
            continue
        module = importlib.import_module(f"kvcache.bench.{name.replace('-', '_')}")
        sub = benches.add_parser(name, help=summary, description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
