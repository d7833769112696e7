"""`kvcache bench engine`: the paged engine beside the model layer's dense, unpaged runner
(`DenseRunner`, same math, contiguous per-sequence K/V) in the same run: prefill tokens/s for
one prompt, decode tokens/s at batch 1 and batch 8, and time to first token for a prompt whose
first pages are in the local prefix cache versus cold. Goals: paged decode >= 0.9x dense; a
cached prefix cutting time to first token >= 10x.

Engine and dense runs alternate (decode: step by step) so both see the same machine load;
each figure is a median (of --repeats runs, or of every decode step).
For a model with a chat template, prefill and time to first token run on a real chat (a long
system prompt and a question, rendered with the template: kvcache/bench/chat_prompt.py), and
"warm" means another question after the same system prompt ran first, as in a deployment; for
one without, on random token ids (fixed seed), warm sharing every page but the last. Decode
contexts are random token ids (what they say does not change a step's cost). Both sides take
the greedy next token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from base.pages import KV_DTYPES
from base.pages import DEFAULT_PAGE_TOKENS
from kvcache.bench.chat_prompt import BenchChat
from kvcache.bench.report import dump_json, machine, print_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt2-small-shape", help="tiny, gpt2-small-shape, smollm2-135m, a .gguf file or a checkpoint folder")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="prompt length for prefill and TTFT, a chat's at most (default 512)")
    parser.add_argument("--decode-context", type=int, default=128, help="prompt length before decoding (default 128)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="decode steps measured (default 32)")
    parser.add_argument("--batch", type=int, default=8, help="the larger decode batch (default 8)")
    parser.add_argument("--page-tokens", type=int, default=DEFAULT_PAGE_TOKENS,
                        help=f"tokens per page (default {DEFAULT_PAGE_TOKENS})")
    parser.add_argument("--kv-dtype", default="float32", choices=KV_DTYPES)
    parser.add_argument("--numerics", default="invariant", choices=["invariant", "fast"],
                        help="the engine's numerics (worker/model/invariant.py; default invariant); the dense "
                             "reference runs the same weight products")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is shown (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    from worker.engine.engine import Engine
    from worker.model import load_model
    from worker.model.dense import DenseRunner

    if min(args.prompt_tokens, args.decode_context, args.decode_tokens, args.batch, args.page_tokens, args.repeats) < 1:
        print("kvcache bench engine: error: every count must be positive", file=sys.stderr)
        return 2
    if args.prompt_tokens <= args.page_tokens:
        print("kvcache bench engine: error: --prompt-tokens must exceed one page", file=sys.stderr)
        return 2
    model = load_model(args.model, invariant=args.numerics == "invariant")
    try:
        chat = BenchChat(model, args.prompt_tokens, 2 * args.repeats) if model.chat_template is not None else None
    except ValueError as exc:
        print(f"kvcache bench engine: error: --prompt-tokens {args.prompt_tokens}: {exc}", file=sys.stderr)
        return 2
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

    pairs = ChatPairs(chat) if chat is not None else RandomPairs(prompt, args.prompt_tokens, args.page_tokens)
    result = {"bench": "engine", "machine": machine(), "model": model.name,
              "options": {k: v for k, v in vars(args).items() if k != "run"}, "prompts": pairs.describe()}
    result["prefill"] = measure_prefill(engine, dense, pairs, args)
    result["decode"] = [measure_decode(engine, dense, prompt, args, b) for b in sorted({1, args.batch})]
    result["ttft"] = measure_ttft(engine, dense, pairs, args)
    if args.json:
        dump_json(result)
        return 0
    print_report(result)
    return 0


class ChatPairs:
    """Prompts for prefill and TTFT from a chat: question 2r is measured, 2r + 1 warms the cache."""

    def __init__(self, chat: BenchChat):
        self.chat = chat

    def pair(self, repeat: int) -> tuple[list[int], list[int]]:
        """(the prompt measured, one with the same beginning to run first)."""
        return self.chat.token_ids(2 * repeat), self.chat.token_ids(2 * repeat + 1)

    def describe(self) -> dict:
        ids = self.chat.token_ids(0)
        return {"kind": "chat", "system_rules": self.chat.num_rules, "tokens": len(ids),
                "system_tokens": len(self.chat.model.chat_token_ids([{"role": "system", "content": self.chat.system}]))}


class RandomPairs:
    """Random token ids; the cache-warming prompt shares every page but the last."""

    def __init__(self, prompt, n: int, page_tokens: int):
        self.prompt, self.n, self.shared = prompt, n, (n - 1) // page_tokens * page_tokens

    def pair(self, repeat: int) -> tuple[list[int], list[int]]:
        ids = self.prompt(self.n)
        return ids, ids[:self.shared] + self.prompt(self.n - self.shared)

    def describe(self) -> dict:
        return {"kind": "random token ids", "tokens": self.n}


def measure_prefill(engine, dense, pairs, args) -> dict:
    """Tokens/s of each run, median (a chat's questions differ in length by a few tokens)."""
    engine_rate, dense_rate, lengths = [], [], []
    for r in range(args.repeats):
        ids, _ = pairs.pair(r)
        lengths.append(len(ids))
        start = time.perf_counter()
        engine.generate([ids], max_new_tokens=1, bypass_cache=True)
        engine_rate.append(len(ids) / (time.perf_counter() - start))
        start = time.perf_counter()
        logits, _ = dense.prefill(ids)
        int(np.argmax(logits))
        dense_rate.append(len(ids) / (time.perf_counter() - start))
    e, d = statistics.median(engine_rate), statistics.median(dense_rate)
    return {"prompt_tokens": int(statistics.median(lengths)), "engine_tokens_per_s": e, "dense_tokens_per_s": d,
            "ratio": e / d}


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


def measure_ttft(engine, dense, pairs, args) -> dict:
    """Cold: nothing cached. Warm: another prompt with the same beginning ran first (another
    question after the same system prompt, for a chat), so the pages they share are in the local
    prefix cache."""
    P = args.page_tokens
    cold_ms, warm_ms, dense_ms, warm_cached, expected, lengths = [], [], [], [], [], []
    for r in range(args.repeats):
        ids, filler = pairs.pair(r)
        n = len(ids)
        lengths.append(n)
        start = time.perf_counter()
        dense.prefill(ids)
        dense_ms.append((time.perf_counter() - start) * 1000)
        cold = engine.generate([ids], max_new_tokens=1, bypass_cache=True)[0]
        cold_ms.append(cold.usage.ttft_ms)
        engine.generate([filler], max_new_tokens=1)  # fills the cache
        warm = engine.generate([ids], max_new_tokens=1)[0]
        warm_ms.append(warm.usage.ttft_ms)
        warm_cached.append(warm.usage.cached_tokens_local)
        expected.append(min(min(_common_prefix(ids, filler), n) // P * P, n - 1))  # the last token is computed
    assert warm_cached == expected, f"expected {expected} cached tokens, got {warm_cached}"
    cached = min(warm_cached)
    cold, warm, d = statistics.median(cold_ms), statistics.median(warm_ms), statistics.median(dense_ms)
    return {"prompt_tokens": int(statistics.median(lengths)), "cached_tokens": cached, "cold_ms": cold, "warm_ms": warm, "dense_ms": d,
            "speedup": cold / warm, "cold_vs_dense": d / cold}


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def print_report(result: dict) -> None:
    o = result["options"]
    print(f"engine bench: {result['model']}, {o['kv_dtype']} KV, pages of {o['page_tokens']} tokens, "
          f"{o.get('numerics', 'invariant')} numerics, median of {o['repeats']}")
    kind = "chat" if result["prompts"]["kind"] == "chat" else "prompt"
    if kind == "chat":
        print(f"prompts: a chat, a system prompt of {result['prompts']['system_rules']} house rules "
              f"({result['prompts']['system_tokens']} tokens) and a question, in the model's chat template")
    p = result["prefill"]
    rows = [[f"prefill tokens/s ({p['prompt_tokens']}-token {kind})", p["engine_tokens_per_s"],
             p["dense_tokens_per_s"], p["ratio"]]]
    for d in result["decode"]:
        rows.append([f"decode tokens/s (batch {d['batch']}, {d['context_tokens']}-token context)",
                     d["engine_tokens_per_s"], d["dense_tokens_per_s"], d["ratio"]])
    t = result["ttft"]
    rows.append([f"TTFT ms cold ({t['prompt_tokens']}-token {kind})", t["cold_ms"], t["dense_ms"], t["cold_vs_dense"]])
    print_table(["measure", "paged engine", "dense reference", "engine/dense"], rows)
    print()
    print_table(["time to first token", "ms"], [
        ["cold (nothing cached)", t["cold_ms"]],
        [f"warm ({t['cached_tokens']} of {t['prompt_tokens']} tokens in the local prefix cache)", t["warm_ms"]],
        ["speedup cold/warm (goal >= 10x)", t["speedup"]],
    ])
    worst = min(d["ratio"] for d in result["decode"])
    print(f"\npaged decode vs dense: {worst:.2f}x at worst (goal >= 0.9x)")
