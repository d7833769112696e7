"""`kvcache bench engine`: the paged engine beside the model layer's dense, unpaged runner
(`DenseRunner`, same math, contiguous per-sequence K/V) in the same run: prefill tokens/s for
one prompt, decode tokens/s at batch 1 and batch 8, and time to first token for a prompt whose
first pages are in the local prefix cache versus cold. Goals: paged decode >= 0.9x dense; a
cached prefix cutting time to first token >= 10x.

Engine and dense runs alternate (decode: step by step) so both see the same machine load;
each figure is a median (of --repeats runs, or of every decode step).
Prompts are random token ids (fixed seed); both sides take the greedy next token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from kvcache.bench.report import dump_json, machine, print_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt2-small-shape", help="tiny, gpt2-small-shape, smollm2-135m, a .gguf file or a checkpoint folder")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt length for prefill and TTFT (default 512)")
    parser.add_argument("--decode-context", type=int, default=128, help="prompt length before decoding (default 128)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="decode steps measured (default 32)")
    parser.add_argument("--batch", type=int, default=8, help="the larger decode batch (default 8)")
    parser.add_argument("--page-tokens", type=int, default=16, help="tokens per page (default 16)")
    parser.add_argument("--kv-dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is shown (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    from worker.engine import Engine
    from worker.model import load_model
    from worker.model.dense import DenseRunner

    if min(args.prompt_tokens, args.decode_context, args.decode_tokens, args.batch, args.page_tokens, args.repeats) < 1:
        print("kvcache bench engine: error: every count must be positive", file=sys.stderr)
        return 2
    if args.prompt_tokens <= args.page_tokens:
        print("kvcache bench engine: error: --prompt-tokens must exceed one page", file=sys.stderr)
        return 2
    model = load_model(args.model)
    longest = max(args.prompt_tokens, args.decode_context + args.decode_tokens + 1)
    if longest > model.config.max_positions:
        print(f"kvcache bench engine: error: {longest} tokens exceed the model's {model.config.max_positions} positions",
              file=sys.stderr)
        return 2
    pages_per_seq = -(-longest // args.page_tokens) + 1
    engine = Engine(model, kv_dtype=args.kv_dtype, page_tokens=args.page_tokens,
                    num_blocks=pages_per_seq * (args.batch + 3), max_num_seqs=max(args.batch, 1),
                    max_num_batched_tokens=max(args.prompt_tokens, args.batch))
    dense = DenseRunner(model, args.kv_dtype)
    rng = np.random.default_rng(0)
    vocab = min(model.config.vocab_size, 50_000)

    def prompt(n):
        return [int(t) for t in rng.integers(0, vocab, size=n)]

    result = {"bench": "engine", "machine": machine(), "model": model.name,
              "options": {k: v for k, v in vars(args).items() if k != "run"}}
    result["prefill"] = measure_prefill(engine, dense, prompt, args)
    result["decode"] = [measure_decode(engine, dense, prompt, args, b) for b in sorted({1, args.batch})]
    result["ttft"] = measure_ttft(engine, dense, prompt, args)
    if args.json:
        dump_json(result)
        return 0
    print_report(result)
    return 0


def measure_prefill(engine, dense, prompt, args) -> dict:
    n = args.prompt_tokens
    engine_s, dense_s = [], []
    for _ in range(args.repeats):
        ids = prompt(n)
        start = time.perf_counter()
        engine.generate([ids], max_new_tokens=1, bypass_cache=True)
        engine_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        logits, _ = dense.prefill(ids)
        int(np.argmax(logits))
        dense_s.append(time.perf_counter() - start)
    e, d = statistics.median(engine_s), statistics.median(dense_s)
    return {"prompt_tokens": n, "engine_tokens_per_s": n / e, "dense_tokens_per_s": n / d, "ratio": d / e}


def measure_decode(engine, dense, prompt, args, batch: int) -> dict:
    """Engine steps and dense decode steps alternate one by one, so both see the same machine load;
    tokens/s comes from the median step time of each side."""
    steps = args.decode_tokens
    engine_s, dense_s = [], []
    for _ in range(args.repeats):
        prompts = [prompt(args.decode_context) for _ in range(batch)]
        # ignore_eos: a trained model may end a random prompt's answer early
        handles = [engine.add_request(p, max_new_tokens=steps + 1, bypass_cache=True, ignore_eos=True)
                   for p in prompts]
        while any(h.queue.empty() for h in handles):  # every prompt prefilled, first token out
            engine.step()
        states, tokens = [], []
        for p in prompts:
            logits, state = dense.prefill(p)
            states.append(state)
            tokens.append(int(np.argmax(logits)))
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            engine_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            logits = dense.decode(states, tokens)
            tokens = [int(t) for t in np.argmax(logits, axis=-1)]
            dense_s.append(time.perf_counter() - start)
        assert not engine.has_unfinished(), "decode did not end after the measured steps"
        assert all(len(h.completion.token_ids) == steps + 1 for h in handles), "decode ended early"
    e, d = statistics.median(engine_s), statistics.median(dense_s)
    return {"batch": batch, "context_tokens": args.decode_context, "steps": steps,
            "engine_tokens_per_s": batch / e, "dense_tokens_per_s": batch / d, "ratio": d / e}


def measure_ttft(engine, dense, prompt, args) -> dict:
    """Cold: nothing cached. Warm: another prompt with the same beginning ran first, so every
    page before the last token's page is in the local prefix cache."""
    n, P = args.prompt_tokens, args.page_tokens
    cached = (n - 1) // P * P
    cold_ms, warm_ms, dense_ms, warm_cached = [], [], [], []
    for _ in range(args.repeats):
        ids = prompt(n)
        start = time.perf_counter()
        dense.prefill(ids)
        dense_ms.append((time.perf_counter() - start) * 1000)
        cold = engine.generate([ids], max_new_tokens=1, bypass_cache=True)[0]
        cold_ms.append(cold.usage.ttft_ms)
        engine.generate([ids[:cached] + prompt(n - cached)], max_new_tokens=1)  # fills the cache
        warm = engine.generate([ids], max_new_tokens=1)[0]
        warm_ms.append(warm.usage.ttft_ms)
        warm_cached.append(warm.usage.cached_tokens_local)
    assert set(warm_cached) == {cached}, f"expected {cached} cached tokens, got {warm_cached}"
    cold, warm, d = statistics.median(cold_ms), statistics.median(warm_ms), statistics.median(dense_ms)
    return {"prompt_tokens": n, "cached_tokens": cached, "cold_ms": cold, "warm_ms": warm, "dense_ms": d,
            "speedup": cold / warm, "cold_vs_dense": d / cold}


def print_report(result: dict) -> None:
    o = result["options"]
    print(f"engine bench: {result['model']}, {o['kv_dtype']} KV, pages of {o['page_tokens']} tokens, "
          f"median of {o['repeats']}")
    p = result["prefill"]
    rows = [[f"prefill tokens/s ({p['prompt_tokens']}-token prompt)", p["engine_tokens_per_s"],
             p["dense_tokens_per_s"], p["ratio"]]]
    for d in result["decode"]:
        rows.append([f"decode tokens/s (batch {d['batch']}, {d['context_tokens']}-token context)",
                     d["engine_tokens_per_s"], d["dense_tokens_per_s"], d["ratio"]])
    t = result["ttft"]
    rows.append([f"TTFT ms cold ({t['prompt_tokens']}-token prompt)", t["cold_ms"], t["dense_ms"], t["cold_vs_dense"]])
    print_table(["measure", "paged engine", "dense reference", "engine/dense"], rows)
    print()
    print_table(["time to first token", "ms"], [
        ["cold (nothing cached)", t["cold_ms"]],
        [f"warm ({t['cached_tokens']} of {t['prompt_tokens']} tokens in the local prefix cache)", t["warm_ms"]],
        ["speedup cold/warm (goal >= 10x)", t["speedup"]],
    ])
    worst = min(d["ratio"] for d in result["decode"])
    print(f"\npaged decode vs dense: {worst:.2f}x at worst (goal >= 0.9x)")
