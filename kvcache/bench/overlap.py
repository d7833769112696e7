"""`kvcache bench overlap`: does fetching one request's prefix from a kvnode overlap with
computing another request on this machine? The question behind layer-wise overlap (computing
layer l of a fetched request's suffix as soon as layer l of its pages landed): that pays only
if the fill and a forward run at once take much less than one after the other.

One process holds what a worker would: an engine whose local cache holds prompt B, and a remote
tier on a pool of its own, through which prompt A's pages (written to a kvnode in another
process beforehand) are fetched again and again. Each round runs, in turns of order:
- one after the other: the fill of A's pages on a thread, joined, then B's suffix (the tokens
  after its cached pages: one forward) on this thread;
- at once: the fill started on its thread, B's suffix computed meanwhile, then joined.
Per mode the wall time, the fill's and the forward's own times, the forward's thread CPU,
the rest of the process's CPU (the fill's threads) and the kvnode's (Linux: /proc).
Medians are printed; the fill's lookup is made before each timed part.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from base.pages import KV_DTYPES
from base import serving
from kvcache.bench.report import dump_json, machine, print_table
from kvcache.launch import Daemon
from kvcache.model_pages import model_page_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt2-small-shape", help="tiny, gpt2-small-shape, smollm2-135m, a .gguf file "
                        "or a checkpoint folder")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="both prompts' length (default 1024)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="float16",
                        help="KV dtype on the wire (default float16)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of both modes; medians are shown (default 6)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    from worker.engine.engine import Engine
    from worker.kv.pages import page_keys, tenant_root
    from worker.remote.tier import Placement, RemoteTier

    if args.rounds < 1:
        print("kvcache bench overlap: error: --rounds must be positive", file=sys.stderr)
        return 2
    try:
        page_bytes = model_page_bytes(args.model, args.kv_dtype)
        pool_bytes = page_bytes * (args.prompt_tokens // 16 + 2) * 2
        writer, local = (Engine.load(args.model, kv_dtype=args.kv_dtype, kv_cache_bytes=pool_bytes) for _ in range(2))
    except ValueError as exc:
        print(f"kvcache bench overlap: error: {exc}", file=sys.stderr)
        return 2
    P = writer.page_tokens
    if not P < args.prompt_tokens <= writer.max_total_tokens:
        print(f"kvcache bench overlap: error: --prompt-tokens must be more than a page ({P}) and at most "
              f"{writer.max_total_tokens}", file=sys.stderr)
        return 2
    serving.tune_allocator()
    rng = np.random.default_rng(0)
    vocab = writer.model.config.vocab_size
    prompt_a, prompt_b = (rng.integers(0, vocab - 1, size=args.prompt_tokens).tolist() for _ in range(2))
    num_pages = args.prompt_tokens // P   # a warm run fetches every full page (its last token is computed)
    keys = page_keys(tenant_root(writer.fingerprint, ""), prompt_a[: num_pages * P], P)
    # The fill's own pool, written once now as the engine's is (first writes into fresh memory page-fault).
    pool = np.empty((num_pages, *writer.kv_pool.shape[1:]), dtype=writer.kv_pool.dtype)
    pool.fill(0.0)
    capacity = str(page_bytes * (num_pages + 2) * 2)  # room to spare (with exactly the pages, a tiny run found 7 of 12)
    with Daemon("node", ["--port", "0", "--page-bytes", str(page_bytes), "--capacity", capacity]) as node:
        writer_tier, tier = RemoteTier(writer.kv_pool, args.kv_dtype), RemoteTier(pool, args.kv_dtype)
        writer.attach_remote_tier(writer_tier)
        placement = Placement([node.address])
        try:
            writer.generate(prompt_a, max_new_tokens=1, tier_context=placement)
            if not writer_tier.flush(timeout_s=60.0):
                raise RuntimeError("write-back to the node did not finish within 60 s")
            local.generate(prompt_b, max_new_tokens=1)  # computed once: B's pages are local from now on
            probe = _Probe(tier, keys, placement, local, prompt_b, num_pages * P, node.pid)
            probe.sequential()  # both paths once before measuring (connections, first touches)
            rounds = {"sequential": [], "at_once": []}
            for number in range(args.rounds):
                for mode in ("sequential", "at_once")[:: 1 if number % 2 == 0 else -1]:
                    rounds[mode].append(getattr(probe, mode)())
        finally:
            tier.close()
            writer_tier.close()
    medians = {mode: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for mode, runs in rounds.items()}
    seq, both = medians["sequential"], medians["at_once"]
    result = {
        "bench": "overlap",
        "machine": machine(),
        "options": {k: v for k, v in vars(args).items() if k != "run"},
        "load_average": os.getloadavg(),
        "ms": medians,
        "samples_ms": rounds,
        "at_once_vs_sequential": both["wall"] / seq["wall"],
        # How much of the shorter of the two disappeared by running them at once (1: all of it).
        "hidden_share": (seq["wall"] - both["wall"]) / min(seq["fill"], seq["forward"]),
    }
    if args.json:
        dump_json(result)
        return 0
    print(f"{args.model}, {args.prompt_tokens}-token prompts, {args.kv_dtype} KV: the fill of {num_pages} pages "
          f"beside a {args.prompt_tokens - num_pages * P}-token suffix forward; median of {args.rounds} rounds, "
          f"load average {result['load_average'][0]:.1f}")
    labels = [("wall", "wall, both parts"), ("fill", "the fill"), ("forward", "the suffix forward"),
              ("forward_cpu", "CPU, the forward's thread"), ("fill_cpu", "CPU, the rest of this process"),
              ("node_cpu", "CPU, the kvnode")]
    print_table(["ms", "one after the other", "at once"], [[label, seq[key], both[key]] for key, label in labels])
    print(f"\nat once / one after the other: {result['at_once_vs_sequential']:.2f}x wall; "
          f"{result['hidden_share']:.0%} of the shorter part hidden")
    return 0


class _Probe:
    """The two modes of a round, each returning its times (ms)."""

    def __init__(self, tier, keys, placement, engine, prompt, cached_tokens: int, node_pid: int):
        self.tier, self.keys, self.placement = tier, keys, placement
        self.engine, self.prompt, self.cached_tokens = engine, prompt, cached_tokens
        self.node_pid = node_pid
        self.blocks = list(range(len(keys)))

    def sequential(self) -> dict[str, float]:
        return self._timed(at_once=False)

    def at_once(self) -> dict[str, float]:
        return self._timed(at_once=True)

    def _timed(self, at_once: bool) -> dict[str, float]:
        found = self.tier.lookup(self.keys, self.placement)  # leased, before the timed part
        if found != len(self.keys):
            raise RuntimeError(f"the kvnode holds {found} of the {len(self.keys)} pages written to it")
        fill: dict[str, float] = {}
        thread = threading.Thread(target=self._fill, args=(fill,), name="bench-fill")
        node_before, process_before, started = _process_cpu_s(self.node_pid), time.process_time(), time.perf_counter()
        thread.start()
        if not at_once:
            thread.join()
        forward_started, cpu_before = time.perf_counter(), time.thread_time()
        completion = self.engine.generate(self.prompt, max_new_tokens=1)[0]
        forward_ms, forward_cpu_ms = (time.perf_counter() - forward_started) * 1000.0, (time.thread_time() - cpu_before) * 1000.0
        thread.join()
        wall = (time.perf_counter() - started) * 1000.0
        process_ms = (time.process_time() - process_before) * 1000.0
        node_after = _process_cpu_s(self.node_pid)
        if "error" in fill:
            raise RuntimeError(f"the fill failed: {fill['error']}")
        if completion.usage.cached_tokens_local != self.cached_tokens:
            raise RuntimeError(f"the suffix request reused {completion.usage.cached_tokens_local} cached tokens, "
                               f"expected {self.cached_tokens}: its pages left the local cache")
        return {"wall": wall, "fill": fill["ms"], "forward": forward_ms, "forward_cpu": forward_cpu_ms,
                "fill_cpu": process_ms - forward_cpu_ms,
                "node_cpu": float("nan") if node_after is None else (node_after - node_before) * 1000.0}

    def _fill(self, out: dict) -> None:
        started = time.perf_counter()
        try:
            filled = self.tier.fill(self.keys, self.blocks, self.placement)
        except Exception as exc:  # reported by the caller
            out["error"] = repr(exc)
            return
        out["ms"] = (time.perf_counter() - started) * 1000.0
        if filled != len(self.keys):
            out["error"] = f"{filled} of {len(self.keys)} pages arrived"


def _process_cpu_s(pid: int) -> float | None:
    """CPU seconds of every thread of process `pid` so far (Linux' schedstat, in ns), None elsewhere."""
    total, tasks = 0, list(Path(f"/proc/{pid}/task").glob("*/schedstat"))
    for stat in tasks:
        try:
            total += int(stat.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total / 1e9 if tasks else None
