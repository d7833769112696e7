"""Does an answer depend on where, when or beside what it ran? One request is computed in every
way the service computes requests: alone (the reference), resumed after k tokens on another
engine (the tokens so far recomputed as a prompt), its prompt in chunks of 16 to 512 tokens,
beside 1 to 15 random neighbours (some arriving during its run), its prefix from the local
cache, its prefix fetched from a kvnode another worker wrote it to. Greedy and seeded (a high
temperature: many near-ties for a draw to fall on), float32 and float16 KV, with invariant
numerics and without (worker/model/invariant.py). Every answer's tokens and the logits of each
of its draws are compared with the reference's, bit for bit. Then the cost of invariant numerics:
prefill and decode at batch 1 and 8, an engine with them beside one without, in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import numpy as np

from kvcache import __version__
from kvcache.bench.report import dump_json, machine, print_table

SAMPLINGS = {"greedy": {}, "seeded": {"temperature": 1.5}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="tiny, gpt2-small-shape, smollm2-135m, a .gguf file or a checkpoint folder (default tiny)")
    parser.add_argument("--tokens", type=int, default=40, help="tokens per answer (default %(default)s)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts, each computed every way (default %(default)s)")
    parser.add_argument("--cuts", type=int, default=2, help="resume points per prompt (default %(default)s)")
    parser.add_argument("--chunks", default="16,64,512", help="prefill chunk sizes (default %(default)s)")
    parser.add_argument("--batches", default="2,8,16", help="batch sizes, the request and random neighbours (default %(default)s)")
    parser.add_argument("--numerics", choices=["both", "invariant", "fast"], default="both",
                        help="run the matrix with invariant numerics, without, or both (default both)")
    parser.add_argument("--kv-dtype", choices=["both", "float32", "float16"], default="both")
    parser.add_argument("--matrix", action=argparse.BooleanOptionalAction, default=True,
                        help="run the comparisons (default on; --no-matrix: the cost alone)")
    parser.add_argument("--cost-repeats", type=int, default=5, help="runs per cost figure, 0 skips the cost (default 5)")
    parser.add_argument("--cost-prompt-tokens", type=int, default=512, help="the cost's prefill prompt (default 512)")
    parser.add_argument("--cost-threads", type=int, default=None, help="BLAS threads (or, invariant, Python threads "
                        "splitting a product) for the cost's forwards, whatever their rows (default: the worker's "
                        "own choice, worker/model/blas.py)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args: argparse.Namespace) -> int:
    try:
        chunks, batches = _sizes(args.chunks, "--chunks"), _sizes(args.batches, "--batches")
        if args.tokens < 2 or args.prompts < 1 or args.cuts < 1 or args.cost_repeats < 0:
            raise ValueError("--tokens must be at least 2, --prompts and --cuts at least 1, --cost-repeats at least 0")
        if args.cost_threads is not None and args.cost_threads < 1:
            raise ValueError(f"--cost-threads must be at least 1, got {args.cost_threads}")
        if max(batches) > 64:
            raise ValueError("--batches: at most 64")
    except ValueError as exc:
        print(f"kvcache bench determinism: error: {exc}", file=sys.stderr)
        return 2
    from worker.model import load_model

    numerics = ["invariant", "fast"] if args.numerics == "both" else [args.numerics]
    kv_dtypes = ["float32", "float16"] if args.kv_dtype == "both" else [args.kv_dtype]
    try:
        models = {n: load_model(args.model, invariant=(n == "invariant")) for n in numerics}
    except (ValueError, OSError) as exc:
        print(f"kvcache bench determinism: error: {exc}", file=sys.stderr)
        return 2
    if "invariant" in models and not models["invariant"].invariant:
        print("kvcache bench determinism: error: the BLAS here cannot give invariant numerics (see the log)",
              file=sys.stderr)
        return 2
    rows = []
    for kv_dtype in kv_dtypes if args.matrix else []:
        with _kvnode(models[numerics[0]], kv_dtype) as node:
            for n in numerics:
                rows += _matrix(models[n], n, kv_dtype, node, args, chunks, batches)
    result = {"bench": "determinism", "version": __version__, "machine": machine(), "model": args.model,
              "tokens": args.tokens, "answers": rows}
    if args.cost_repeats:
        from kvcache.bench.invariant_cost import measure
        from worker.model.blas import forced_threads

        cost_models = {n: models.get(n) or load_model(args.model, invariant=(n == "invariant"))
                       for n in ("fast", "invariant")}
        prompt_tokens = min(args.cost_prompt_tokens, cost_models["fast"].config.max_positions - 1)
        with forced_threads(args.cost_threads) if args.cost_threads else contextlib.nullcontext():
            result["cost"] = measure(cost_models, prompt_tokens, args.cost_repeats)
        result["cost"]["threads"] = args.cost_threads
    if args.json:
        dump_json(result)
        return 0
    print_report(result)
    return 0


def _matrix(model, numerics: str, kv_dtype: str, node: str, args, chunks, batches) -> list[dict]:
    from kvcache.bench.determinism_runs import Runs, prompts

    runs = Runs(model, kv_dtype, args.tokens, node)
    found: dict[tuple[str, str], list] = {}
    for mode, sampling in SAMPLINGS.items():
        for prompt in prompts(model, args.prompts):
            ref = runs.reference(prompt, sampling)
            answers = [(f"resumed after {k} tokens", runs.resumed(prompt, sampling, ref, k))
                       for k in np.linspace(1, args.tokens - 1, args.cuts).astype(int)]
            answers += [(f"prompt in chunks of {c}", runs.chunked(prompt, sampling, c)) for c in chunks]
            answers += [(f"beside {b - 1} random neighbours", runs.batched(prompt, sampling, b)) for b in batches]
            answers += [("prefix from the local cache", runs.cached_locally(prompt, sampling)),
                        ("prefix from a kvnode", runs.fetched(prompt, sampling))]
            for label, answer in answers:
                kind = label if not label.startswith("resumed") else "resumed after k tokens"
                found.setdefault((mode, kind), []).append(_compare(answer, ref))
    return [{"numerics": numerics, "kv_dtype": kv_dtype, "mode": mode, "run": kind, "requests": len(c),
             "tokens_differing": sum(t for t, _, _ in c), "logits_differing": sum(lg for _, lg, _ in c),
             "max_logit_difference": max(d for _, _, d in c)} for (mode, kind), c in found.items()]


def _compare(answer, ref) -> tuple[bool, bool, float]:
    """(tokens differ, logits differ in any bit, largest difference) against the reference's last draws."""
    want = ref.logits[len(ref.logits) - len(answer.logits):]
    tokens_differ = answer.tokens != ref.tokens
    if answer.logits.shape != want.shape:
        return tokens_differ, True, float("inf")
    differ = not np.array_equal(answer.logits.view(np.uint32), want.view(np.uint32))
    return tokens_differ, differ, float(np.abs(answer.logits - want).max())


@contextlib.contextmanager
def _kvnode(model, kv_dtype: str):
    """A kvnode process on loopback for this model's pages, stopped at the end."""
    from kvcache.launch import Daemon
    from worker.model import page_bytes_of

    page_bytes = page_bytes_of(model.config, kv_dtype, 16)
    capacity = max(64 << 20, page_bytes * 512)
    with Daemon("node", ["--port", "0", "--page-bytes", str(page_bytes), "--capacity", str(capacity)]) as node:
        yield node.address


def _sizes(text: str, option: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"{option}: a comma-separated list of numbers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"{option}: positive sizes, got {text!r}")
    return sizes


def print_report(result: dict) -> None:
    from kvcache.bench.invariant_cost import rows as cost_rows

    if result["answers"]:
        print(f"model {result['model']}, {result['tokens']} tokens per answer; each answer's tokens and the logits "
              "of each draw compared bit for bit with the same request run alone")
        print_table(["numerics", "KV", "mode", "run", "requests", "tokens differ", "logits differ", "max |diff|"],
                    [[a["numerics"], a["kv_dtype"], a["mode"], a["run"], a["requests"], a["tokens_differing"],
                      a["logits_differing"], f"{a['max_logit_difference']:.1e}"] for a in result["answers"]])
    if "cost" in result:
        threads = result["cost"].get("threads")
        print(f"\nthe cost of invariant numerics ({result['model']}"
              + (f", {threads} thread(s) for every forward" if threads else "")
              + "): engines with and without them, alternating, best run and median")
        print_table(["measure", "fast", "invariant", "cost (best)", "cost (median)"], cost_rows(result["cost"]))
