"""What invariant numerics cost: an engine with them beside one without, same model, same run.

Prefill tokens/s of one prompt (in the engine's chunks for a prompt alone, --alone-prefill-tokens'
default), and decode tokens/s at batch 1 and 8 (128-token contexts). The two engines alternate,
run by run and decode step by decode step, which one goes first alternating too, so both see the
same machine load; each figure is the best of its runs (the least disturbed) and the median.
Both take the greedy next token.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

MODES = ("fast", "invariant")


def measure(models: dict, prompt_tokens: int, repeats: int, decode_steps: int = 32,
            batches: tuple[int, ...] = (1, 8)) -> dict:
    """models: {"fast": Model, "invariant": Model} -> {"prefill": {...}, "decode": [{...}, ...]}."""
    from worker.engine.engine import Engine

    rng = np.random.default_rng(0)
    vocab = min(models["fast"].config.vocab_size, 50_000)
    context = 128
    longest = max(prompt_tokens, context + decode_steps + 2)
    engines = {m: Engine(models[m], num_blocks=(longest // 16 + 2) * (max(batches) + 2), page_tokens=16,
                         max_num_seqs=max(batches), max_num_batched_tokens=max(prompt_tokens, max(batches)))
               for m in MODES}

    def prompt(n):
        return [int(t) for t in rng.integers(0, vocab, n)]

    def order(i):
        return MODES if i % 2 == 0 else MODES[::-1]

    rates = {m: [] for m in MODES}
    for r in range(repeats):
        ids = prompt(prompt_tokens)
        for m in order(r):
            started = time.perf_counter()
            engines[m].generate([ids], max_new_tokens=1, bypass_cache=True)
            rates[m].append(prompt_tokens / (time.perf_counter() - started))
    result = {"prefill": _summary(rates, {"prompt_tokens": prompt_tokens}), "decode": []}
    for batch in batches:
        rates = {m: [] for m in MODES}
        for r in range(max(1, repeats // 2)):
            prompts = [prompt(context) for _ in range(batch)]
            handles = {m: [engines[m].add_request(p, max_new_tokens=decode_steps + 1, bypass_cache=True,
                                                  ignore_eos=True) for p in prompts] for m in MODES}
            for m in MODES:
                while any(h.queue.empty() for h in handles[m]):   # prefilled, first tokens out
                    engines[m].step()
            for step in range(decode_steps):
                for m in order(step):
                    started = time.perf_counter()
                    engines[m].step()
                    rates[m].append(batch / (time.perf_counter() - started))
            for m in MODES:
                while engines[m].has_unfinished():
                    engines[m].step()
        result["decode"].append(_summary(rates, {"batch": batch, "context_tokens": context}))
    return result


def _summary(rates: dict, what: dict) -> dict:
    best = {m: max(rates[m]) for m in MODES}
    median = {m: statistics.median(rates[m]) for m in MODES}
    return {**what, **{f"{m}_tokens_per_s": best[m] for m in MODES},
            **{f"{m}_median_tokens_per_s": median[m] for m in MODES},
            "cost": best["fast"] / best["invariant"], "median_cost": median["fast"] / median["invariant"]}


def rows(cost: dict) -> list[list]:
    """Table rows: measure, fast, invariant, cost (time with / time without), of the best runs and the medians."""
    p = cost["prefill"]
    out = [[f"prefill tokens/s ({p['prompt_tokens']}-token prompt)", p]]
    out += [[f"decode tokens/s (batch {d['batch']}, {d['context_tokens']}-token context)", d] for d in cost["decode"]]
    return [[label, d["fast_tokens_per_s"], d["invariant_tokens_per_s"], f"{d['cost']:.2f}x",
             f"{d['median_cost']:.2f}x"] for label, d in out]
