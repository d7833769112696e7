"""Do answers depend on where and with whom a request ran? Seeded (temperature 0.8) and greedy
requests are run alone (the reference), resumed after k tokens as another worker would resume
them (the tokens so far recomputed as a prompt), and run in batches of several; every answer is
compared token for token with the reference. Then the cost of the one sure fix, products whose
rows do not depend on their batch (one matrix-vector product per row), against the batched
products of the model's weight matrices, in the same run.

Why it matters: a seeded draw depends only on the seed and the position, but the logits it draws
from come out of BLAS matrix products whose per-row results differ in the last bits with the
number of rows (a decode step of one request, of four, a prefill chunk). A draw that falls on a
near-tie can then pick another token.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from kvcache import __version__
from kvcache.bench.report import dump_json, machine, print_table
from kvcache.model_pages import MODELS
from worker.engine.engine import Engine
from worker.model import load_model
from worker.model.blas import threads_for_rows

KV_CACHE_BYTES = 64 * 2**20
PROMPTS = [
    "The history of bread begins with wild grains ground between stones, and",
    "Once upon a time in a small village by the sea there lived a baker who",
    "def fibonacci(n):\n    ",
    "Dear customer, thank you for your order of three loaves",
    "Rye, spelt and wheat differ in",
    "In 1850 the mill by the river",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help=f"{MODELS} (default tiny)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per answer (default %(default)s)")
    parser.add_argument("--cuts", type=int, default=4, help="resume points per prompt (default %(default)s)")
    parser.add_argument("--batch", type=int, default=6, help="requests run together in the batched pass (default 6)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    if args.tokens < 2 or args.cuts < 1 or args.batch < 2:
        print("kvcache bench determinism: error: --tokens must be at least 2, --cuts at least 1, --batch at least 2",
              file=sys.stderr)
        return 2
    try:
        model = load_model(args.model)  # one model; each run below gets an engine (a KV pool) of its own
    except (ValueError, OSError) as exc:
        print(f"kvcache bench determinism: error: {exc}", file=sys.stderr)
        return 2
    engine = Engine(model, kv_cache_bytes=KV_CACHE_BYTES)
    modes = {"seeded": {"temperature": 0.8}, "greedy": {}}
    options = {"max_new_tokens": args.tokens, "ignore_eos": True}
    reference = {(mode, i): engine.generate(p, seed=i, **modes[mode], **options)[0].token_ids
                 for mode in modes for i, p in enumerate(PROMPTS)}
    rows = []
    for mode, sampling in modes.items():
        resumed = differing = 0
        for i, prompt in enumerate(PROMPTS):
            for k in np.linspace(1, args.tokens - 1, args.cuts).astype(int):
                fresh = Engine(model, kv_cache_bytes=KV_CACHE_BYTES)  # nothing cached: k tokens recomputed
                tokens = fresh.generate(prompt, seed=i, resumed_token_ids=reference[(mode, i)][:k],
                                        **sampling, **options)[0].token_ids
                resumed += 1
                differing += tokens != reference[(mode, i)]
        rows.append((mode, "resumed after k tokens", resumed, differing))
        batched = differing = 0
        for start in range(0, len(PROMPTS), args.batch):
            group = range(start, min(start + args.batch, len(PROMPTS)))
            fresh = Engine(model, kv_cache_bytes=KV_CACHE_BYTES)
            handles = [fresh.add_request(PROMPTS[i], seed=i, **sampling, **options) for i in group]
            while any(h.completion is None for h in handles):
                fresh.step()
            for i, handle in zip(group, handles):
                batched += 1
                differing += handle.completion.token_ids != reference[(mode, i)]
        rows.append((mode, f"in batches of {args.batch}", batched, differing))
    cost = _row_invariant_cost(engine)
    result = {"bench": "determinism", "version": __version__, "machine": machine(), "model": args.model,
              "tokens": args.tokens,
              "answers": [dict(zip(("mode", "run", "requests", "differing"), r)) for r in rows],
              "row_invariant_products": cost}
    if args.json:
        dump_json(result)
        return 0
    print(f"model {args.model}, {args.tokens} tokens per answer; each compared with the same request run alone")
    print_table(["mode", "run", "requests", "differing"], rows)
    print("\nweight products of one forward, best of 3: batched against one matrix-vector product per row")
    print_table(["rows", "batched ms", "per row ms", "ratio"],
                [(c["rows"], f"{c['batched_ms']:.1f}", f"{c['per_row_ms']:.1f}", f"{c['ratio']:.2f}x") for c in cost])
    return 0


def _row_invariant_cost(engine: Engine) -> list[dict]:
    """Time the model's weight matrices applied to `rows` rows, batched and one row at a time."""
    weights = [w for w in vars(engine.model.params).values() if isinstance(w, np.ndarray) and w.ndim == 2]
    for block in getattr(engine.model.params, "blocks", []):
        weights += [w for w in vars(block).values() if isinstance(w, np.ndarray) and w.ndim == 2]
    weights = [w for w in weights if w.shape[0] <= 4 * engine.model.config.d_model]
    rng = np.random.default_rng(0)
    results = []
    for rows in (1, 4, 16, 128):
        x = rng.standard_normal((rows, max(w.shape[0] for w in weights)), dtype=np.float32)
        with threads_for_rows(rows):  # BLAS threads as the model's forward uses them
            batched = _best(lambda: [x[:, :w.shape[0]] @ w for w in weights])
        with threads_for_rows(1):
            per_row = _best(lambda: [[r[:w.shape[0]] @ w for r in x] for w in weights])
        results.append({"rows": rows, "batched_ms": batched * 1e3, "per_row_ms": per_row * 1e3,
                        "ratio": per_row / batched})
    return results


def _best(work, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)
