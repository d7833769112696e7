"""`kvcache bench kv-dtype`: each KV dtype (float32, float16, int8, int4) in one run, float32 the
baseline: the model's perplexity on a fixed English text (kvcache/bench/data, computed over the
paged pool in the dtype, chunks of 256 tokens, so every token attends to the stored KV), pages per
GiB, the hit rate of the Mooncake trace (--trace) replayed at one byte budget through the kvnode's
page store (as `bench eviction` does, policy prefix-lru), and, against kvnode processes on
loopback: the fill time of a warm --prompt-tokens prompt (pages copied, not read in place) from a
node's shared pool and over the socket (as from another host), prefill tokens/s (the cold prompt)
and decode tokens/s (batch 1 on that context), each also per second of this process's CPU time
(steadier than the wall clock on a shared machine).

Goals: int8 within 0.5% of float32's perplexity at >= 1.9x float16's pages per GiB, int4 within 3%
at >= 3x; int4's trace hit rate >= float16's + 5 points; fills shorter in proportion to the bytes
(beyond the part no dtype changes, fitted: fixed_fill_ms); decode >= 0.8x float16's (per CPU second)."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from base.pages import DEFAULT_PAGE_TOKENS, KV_DTYPES
from kvcache.bench.report import dump_json, machine, print_table

TEXT = Path(__file__).parent / "data" / "kv_dtype_text.txt"
PPL_CHUNK = 256
POLICY = "prefix-lru"
FILL_PROPORTION_TOLERANCE = 0.15


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from worker.model.named import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"the model (default {DEFAULT_MODEL})")
    parser.add_argument("--dtypes", default=",".join(KV_DTYPES), help=f"KV dtypes (default {','.join(KV_DTYPES)})")
    parser.add_argument("--text-tokens", type=int, default=0, help="perplexity over the text's first N tokens (default all)")
    parser.add_argument("--trace", metavar="FILE", help="a trace in Mooncake's format for the hit rate (skipped without)")
    parser.add_argument("--budget-percent", type=float, default=10.0,
                        help="the trace's byte budget: what holds this %% of its distinct blocks in float16 KV (default 10)")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="the warm prompt's tokens (default 1024)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded to time decode (default 32)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per dtype, medians reported (default 2)")
    parser.add_argument("--skip", default="", help="parts to leave out: ppl, trace, serve (comma-separated)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    from worker.model import load_model

    dtypes = [d for d in args.dtypes.split(",") if d]
    skip = {s for s in args.skip.split(",") if s}
    if not dtypes or any(d not in KV_DTYPES for d in dtypes) or skip - {"ppl", "trace", "serve"}:
        print(f"kvcache bench kv-dtype: error: --dtypes takes {', '.join(KV_DTYPES)}; --skip ppl, trace, serve",
              file=sys.stderr)
        return 2
    try:
        model = load_model(args.model)
    except ValueError as exc:
        print(f"kvcache bench kv-dtype: error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    rows = {d: {"kv_dtype": d, "page_bytes": model.page_bytes(d, DEFAULT_PAGE_TOKENS)} for d in dtypes}
    for d in dtypes:
        rows[d]["pages_per_gib"] = 2**30 // rows[d]["page_bytes"]
    if "ppl" not in skip:
        ids = model.tokenizer.encode(TEXT.read_text())
        ids = ids[: args.text_tokens or len(ids)][: model.config.max_positions]
        for d in dtypes:
            t = time.perf_counter()
            rows[d]["perplexity"] = perplexity(model, ids, d)
            rows[d]["perplexity_s"] = time.perf_counter() - t
            _say(f"{d}: perplexity {rows[d]['perplexity']:.4f} over {len(ids)} tokens")
    trace_info = None
    if args.trace and "trace" not in skip:
        trace_info = hit_rates(args.trace, args.budget_percent, rows, model)
    if "serve" not in skip:
        for d, figures in serve(model, dtypes, args).items():
            rows[d].update(figures)
    result = {"bench": "kv-dtype", "machine": machine(), "model": args.model,
              "options": {k: v for k, v in vars(args).items() if k != "run"},
              "text_tokens": len(ids) if "ppl" not in skip else None, "trace": trace_info,
              "results": [rows[d] for d in dtypes], "seconds": time.perf_counter() - started}
    result["ratios"] = ratios(rows)
    result["goals"] = goals(result["ratios"])
    if args.json:
        dump_json(result, sys.stdout)
    else:
        report(result)
    return 0


def perplexity(model, ids: list[int], kv_dtype: str) -> float:
    """exp(mean NLL of each next token), the text computed in chunks over a paged pool in `kv_dtype`."""
    from worker.kv.quant import storage_dtype
    from worker.model import ForwardBatch, kv_block_shape

    n, P = len(ids), DEFAULT_PAGE_TOKENS
    blocks = -(-n // P)
    pool = np.zeros((blocks, *kv_block_shape(model.config, kv_dtype, P)), dtype=storage_dtype(kv_dtype))
    table = np.arange(blocks)
    tokens = np.asarray(ids, dtype=np.int64)
    nll = 0.0
    for lo in range(0, n - 1, PPL_CHUNK):
        hi = min(n, lo + PPL_CHUNK)
        batch = ForwardBatch(tokens[lo:hi], np.arange(lo, hi), np.array([0, hi - lo]), np.array([hi]), [table],
                             all_logits=True)
        logits = model.forward(batch, pool, kv_dtype).astype(np.float64)
        targets = tokens[lo + 1: hi + 1]
        logits = logits[: len(targets)]
        top = logits.max(axis=-1)
        lse = np.log(np.exp(logits - top[:, None]).sum(axis=-1)) + top
        nll += float((lse - logits[np.arange(len(targets)), targets]).sum())
    return float(np.exp(nll / (n - 1)))


def hit_rates(trace: str, percent: float, rows: dict, model) -> dict:
    """The trace through a page store of one byte budget per dtype: hit rate in prompt tokens."""
    from kvcache.bench.eviction import replay
    from kvcache.bench.mooncake_trace import read_trace, unique_pages

    requests = read_trace(trace)
    distinct = unique_pages(requests)
    block_tokens = requests[0].block_tokens[0]
    prompt_tokens = sum(r.prompt_tokens for r in requests)
    block_bytes = {d: model.page_bytes(d, block_tokens) for d in KV_DTYPES}   # a trace block as one page
    budget = int(percent / 100 * distinct * block_bytes["float16"])
    for d, row in rows.items():
        capacity = max(1, budget // block_bytes[d])
        figures = replay(requests, POLICY, capacity)
        row.update(trace_capacity_blocks=capacity, trace_hit_rate=figures["hit_tokens"] / prompt_tokens)
        _say(f"{d}: trace hit rate {row['trace_hit_rate']:.3f} with {capacity} blocks")
    return {"file": Path(trace).name, "requests": len(requests), "distinct_blocks": distinct,
            "block_tokens": block_tokens, "budget_bytes": budget, "budget_percent_float16": percent, "policy": POLICY}


# Each fill path: the node's options and the name of its figures. A node whose pool readers on this
# host map and copy from, and one that sends its pages over the socket, as a node on another host does.
FILL_PATHS = {"pool": ([], "fill"), "socket": (["--no-shared-pool"], "fill_socket")}


def serve(model, dtypes: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Per dtype, a writer engine, two kvnode processes (one whose pool readers on this host map and
    copy from, one that sends its pages over the socket, as a node on another host does) and a
    reader engine for each; each repeat runs every dtype in turn (a loaded machine's drift then falls
    on all alike): the cold prefill, decode on the warm prompt, and each reader's warm fill. Medians."""
    from kvcache.bench.remote import Daemon, _first_contact
    from worker.engine.engine import Engine
    from worker.remote.tier import Placement, RemoteTier

    pages = args.prompt_tokens // DEFAULT_PAGE_TOKENS + 2
    setups, samples = {}, {}
    with contextlib.ExitStack() as stack:
        for d in dtypes:
            page_bytes = model.page_bytes(d, DEFAULT_PAGE_TOKENS)
            pool_bytes = page_bytes * (pages + args.decode_tokens // DEFAULT_PAGE_TOKENS + 2) * 3
            capacity = str(page_bytes * pages * (args.repeats + 1))
            writer = Engine(model, kv_dtype=d, kv_cache_bytes=pool_bytes)
            readers = {}
            for path, (options, _) in FILL_PATHS.items():
                node = stack.enter_context(Daemon("node", ["--port", "0", "--page-bytes", str(page_bytes),
                                                           "--capacity", capacity, *options]))
                reader = Engine(model, kv_dtype=d, kv_cache_bytes=pool_bytes)
                tier = RemoteTier(reader.kv_pool, d, read_in_place=False)
                reader.attach_remote_tier(tier)
                stack.callback(tier.close)
                readers[path] = (reader, tier, Placement([node.address]))
                _first_contact(tier, readers[path][2])
                mapped = _maps_pool(tier, node.address)
                if mapped != (path == "pool"):   # else the figures would be the other path's under this one's name
                    raise RuntimeError(f"{d}: the reader of the {path} node has its pool "
                                       f"{'mapped' if mapped else 'unmapped'}: this machine cannot measure both paths")
            writer_tier = RemoteTier(writer.kv_pool, d, read_in_place=False)
            writer.attach_remote_tier(writer_tier)
            stack.callback(writer_tier.close)
            both = Placement([placement.addresses[0] for _, _, placement in readers.values()])
            setups[d] = (writer, writer_tier, both, readers)
            samples[d] = {"prefill_tokens_per_s": [], "decode_tokens_per_s": [], "warm_ttft_ms": [], "cold_ttft_ms": [],
                          "prefill_cpu_tokens_per_s": [], "decode_cpu_tokens_per_s": [],
                          **{f"{stem}_ms": [] for _, stem in FILL_PATHS.values()}}
        rng = np.random.default_rng(0)
        for repeat in range(args.repeats):
            prompt = rng.integers(0, model.config.vocab_size - 1, size=args.prompt_tokens).tolist()
            for d in dtypes:
                writer, writer_tier, both, readers = setups[d]
                cpu = time.process_time()
                cold = writer.generate(prompt, max_new_tokens=1, bypass_cache=True)[0]
                prefill_cpu_s = time.process_time() - cpu
                writer.generate(prompt, max_new_tokens=1, tier_context=both)   # its pages to both nodes
                cpu = time.process_time()
                writer.generate(prompt, max_new_tokens=1, tier_context=both)
                cpu_one = time.process_time() - cpu
                cpu, t = time.process_time(), time.perf_counter()
                decoded = writer.generate(prompt, max_new_tokens=args.decode_tokens, ignore_eos=True, tier_context=both)[0]
                wall_ms, cpu_many = (time.perf_counter() - t) * 1000.0, time.process_time() - cpu
                if not writer_tier.flush(timeout_s=60.0):
                    raise RuntimeError("write-back to the nodes did not finish within 60 s")
                s = samples[d]
                for path in sorted(readers, reverse=bool(repeat % 2)):   # each path first every other repeat
                    reader, tier, placement = readers[path]
                    fill_before = tier.stats.fill_ms
                    warm = reader.generate(prompt, max_new_tokens=1, tier_context=placement)[0]
                    if warm.usage.cached_tokens_remote == 0 or warm.token_ids != cold.token_ids:
                        raise RuntimeError(f"{d}: the warm run ({path}) fetched {warm.usage.cached_tokens_remote} tokens "
                                           f"and its token is {'the same' if warm.token_ids == cold.token_ids else 'another'}")
                    s[f"{FILL_PATHS[path][1]}_ms"].append(tier.stats.fill_ms - fill_before)
                    if path == "pool":
                        s["warm_ttft_ms"].append(warm.usage.ttft_ms)
                s["cold_ttft_ms"].append(cold.usage.ttft_ms)
                s["prefill_tokens_per_s"].append(args.prompt_tokens / (cold.usage.ttft_ms / 1000.0))
                s["decode_tokens_per_s"].append((args.decode_tokens - 1) / ((wall_ms - decoded.usage.ttft_ms) / 1000.0))
                s["prefill_cpu_tokens_per_s"].append(args.prompt_tokens / prefill_cpu_s)
                s["decode_cpu_tokens_per_s"].append((args.decode_tokens - 1) / (cpu_many - cpu_one))
                _say(f"{d}: fill {s['fill_ms'][-1]:.1f} ms from the shared pool, {s['fill_socket_ms'][-1]:.1f} ms over "
                     f"the socket, prefill {s['prefill_tokens_per_s'][-1]:.0f} tok/s "
                     f"({s['prefill_cpu_tokens_per_s'][-1]:.0f} a CPU second), decode {s['decode_tokens_per_s'][-1]:.2f} "
                     f"tok/s ({s['decode_cpu_tokens_per_s'][-1]:.2f} a CPU second)")
    out = {}
    for d in dtypes:
        out[d] = {name: statistics.median(values) for name, values in samples[d].items()}
        out[d]["samples"] = samples[d]
        out[d]["fill_bytes"] = (args.prompt_tokens // DEFAULT_PAGE_TOKENS) * model.page_bytes(d, DEFAULT_PAGE_TOKENS)
    return out


def _maps_pool(tier, address: str) -> bool:
    """Whether the tier's client reads `address`'s pages out of its mapped pool."""
    with tier.nodes.use([address]) as nodes:
        return bool(nodes) and nodes[0].client.shared_pool_state() == "mapped"


def fixed_fill_ms(rows: dict, name: str) -> float | None:
    """The part of a fill that no dtype changes (its round trip, the bookkeeping of the same number
    of pages on both sides): the intercept of fill = fixed + rate x page bytes, fitted by least
    squares over float16 and the dtypes smaller than it; None with fewer than three such dtypes,
    which a line fits whatever they measured."""
    half = rows.get("float16", {}).get("page_bytes")
    points = [(row["page_bytes"], row[name]) for row in rows.values() if name in row and half and row["page_bytes"] <= half]
    if len(points) < 3:
        return None
    rate, fixed = np.polyfit([x for x, _ in points], [y for _, y in points], 1)
    return float(fixed)


def ratios(rows: dict) -> dict:
    """Each dtype against float32 (perplexity) and float16 (pages, hit rate, fill, speed)."""
    out = {}
    fixed = {stem: fixed_fill_ms(rows, f"{stem}_ms") for _, stem in FILL_PATHS.values()}
    for d, row in rows.items():
        r = {}
        if "perplexity" in row and "float32" in rows:
            r["perplexity_vs_float32"] = row["perplexity"] / rows["float32"]["perplexity"] - 1
        if "float16" in rows:
            half = rows["float16"]
            r["pages_vs_float16"] = row["pages_per_gib"] / half["pages_per_gib"]
            r["bytes_vs_float16"] = row["page_bytes"] / half["page_bytes"]
            if "trace_hit_rate" in row:
                r["hit_rate_points_vs_float16"] = 100 * (row["trace_hit_rate"] - half["trace_hit_rate"])
            for _, stem in FILL_PATHS.values():
                name = f"{stem}_ms"
                if name not in row:
                    continue
                r[f"{stem}_vs_float16"] = row[name] / half[name]
                if fixed[stem] is not None and half[name] > fixed[stem]:
                    r[f"{stem}_fixed_ms"] = fixed[stem]
                    r[f"{stem}_beyond_fixed_vs_float16"] = (row[name] - fixed[stem]) / (half[name] - fixed[stem])
            if "decode_tokens_per_s" in row:
                for name in ("decode", "prefill", "decode_cpu", "prefill_cpu"):
                    r[f"{name}_vs_float16"] = row[f"{name}_tokens_per_s"] / half[f"{name}_tokens_per_s"]
        out[d] = r
    return out


def goals(r: dict) -> dict:
    out = {}
    for d, ppl, pages in (("int8", 0.005, 1.9), ("int4", 0.03, 3.0)):
        if d in r and "perplexity_vs_float32" in r[d]:
            out[f"{d}_perplexity_within_{ppl:.1%}"] = r[d]["perplexity_vs_float32"] <= ppl
        if d in r and "pages_vs_float16" in r[d]:
            out[f"{d}_pages_at_least_{pages}x_float16"] = r[d]["pages_vs_float16"] >= pages
        if d in r and "decode_cpu_vs_float16" in r[d]:   # CPU time: the wall clock of a shared machine drifts 2x
            out[f"{d}_decode_at_least_0.8x_float16"] = r[d]["decode_cpu_vs_float16"] >= 0.8
        for _, stem in FILL_PATHS.values():
            beyond = r.get(d, {}).get(f"{stem}_beyond_fixed_vs_float16")
            if beyond is not None:  # the bytes' part of the fill at most in proportion to them (15% for noise)
                out[f"{d}_{stem}_beyond_fixed_in_proportion_to_bytes"] = \
                    beyond <= r[d]["bytes_vs_float16"] * (1 + FILL_PROPORTION_TOLERANCE)
    if "int4" in r and "hit_rate_points_vs_float16" in r["int4"]:
        out["int4_hit_rate_5_points_over_float16"] = r["int4"]["hit_rate_points_vs_float16"] >= 5
    return out


def report(result: dict) -> None:
    text = f"{result['text_tokens']} tokens of text" if result["text_tokens"] is not None else "no perplexity (--skip ppl)"
    print(f"bench kv-dtype: {result['model']}, {text}, {result['seconds']:.0f} s")
    if result["trace"]:
        t = result["trace"]
        print(f"trace {t['file']}: {t['requests']} requests, {t['distinct_blocks']} distinct blocks of {t['block_tokens']} "
              f"tokens; budget {t['budget_bytes'] / 2**30:.2f} GiB ({t['budget_percent_float16']}% of them in float16), "
              f"{t['policy']}")
    headers = ["KV dtype", "page bytes", "pages/GiB", "x float16", "perplexity", "vs float32", "trace hits",
               "points vs f16", "bytes/f16", "fill ms", "fill/f16", "beyond fixed/f16", "socket fill ms",
               "socket fill/f16", "beyond fixed/f16", "prefill tok/s", "decode tok/s", "decode tok/CPU s",
               "decode CPU/f16"]
    table = []
    for row in result["results"]:
        r = result["ratios"][row["kv_dtype"]]
        ppl = r.get("perplexity_vs_float32")
        table.append([row["kv_dtype"], row["page_bytes"], row["pages_per_gib"], r.get("pages_vs_float16"),
                      row.get("perplexity"), None if ppl is None else f"{ppl:+.2%}", row.get("trace_hit_rate"),
                      r.get("hit_rate_points_vs_float16"), r.get("bytes_vs_float16"),
                      row.get("fill_ms"), r.get("fill_vs_float16"), r.get("fill_beyond_fixed_vs_float16"),
                      row.get("fill_socket_ms"), r.get("fill_socket_vs_float16"),
                      r.get("fill_socket_beyond_fixed_vs_float16"), row.get("prefill_tokens_per_s"),
                      row.get("decode_tokens_per_s"), row.get("decode_cpu_tokens_per_s"), r.get("decode_cpu_vs_float16")])
    print_table(headers, table)
    fixed = {stem: r[f"{stem}_fixed_ms"] for r in result["ratios"].values() for stem in ("fill", "fill_socket")
             if f"{stem}_fixed_ms" in r}
    if fixed:
        print(f"fixed part of a fill (fitted over float16 and the smaller dtypes: fill = fixed + rate x bytes): "
              f"{fixed.get('fill', float('nan')):.2f} ms from the shared pool, "
              f"{fixed.get('fill_socket', float('nan')):.2f} ms over the socket")
    for goal, met in result["goals"].items():
        print(f"goal {goal}: {'met' if met else 'NOT met'}")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
