"""`kvcache bench remote`: time to first token for one long prompt computed cold, fetched
warm from a kvnode in another process, and warm from the worker's local prefix cache,
in one run, with the ratios, the KV bytes fetched and the fetch rate achieved.

Two engines share this process: A computes each prompt (cold, caches bypassed), then
runs it again to write its pages to the node, keeping them in its local cache; B, whose
local cache has never seen the prompt, fetches them from the node (warm remote), and A runs
it once more from its local cache (warm local). The two warm runs take turns going first
from one prompt to the next: on a loaded machine the run right after A's long compute was
slower (the same forward 1.1-1.5x), which always going first put on warm-remote alone.
Every repeat uses a fresh random prompt. Goal: warm-remote >= 10x faster than cold and
within 2x of warm-local.

Each warm run is also broken down (`phases_ms`, medians): from the request's arrival until
the kvnode answered its lookup, until its fill began and ended (warm-remote), until the forward
of its last tokens began, that forward, and what follows it up to the first token. The times
come from the engine's step records and a wrapper around each tier that notes when its lookup
and fill ran, so the gap between the two warm runs can be read as the phases it lies in. With
the layer-wise fill (issue 19, --layerwise-fill) the forward begins before the fill
ends, so "-> the forward began" is then negative: by how much the two overlapped.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Iterator

import numpy as np

from base.pages import KV_DTYPES
from base import serving
from kvcache.bench.report import dump_json, machine, print_table
from kvcache.launch import Daemon
from kvcache.model_pages import model_page_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt2-small-shape", help="tiny, gpt2-small-shape, smollm2-135m, a .gguf file or a checkpoint folder")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length (default 1024)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="float16",
                        help="KV dtype on the wire (default float16, half the bytes)")
    parser.add_argument("--repeats", type=int, default=3, help="prompts measured; medians are shown (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--layerwise-fill", action=argparse.BooleanOptionalAction, default=False,
                        help="the reader computes each layer of the suffix once that layer of its pages landed "
                             "(issue 19; off by default, as in the worker)")
    parser.add_argument("--read-in-place", action=argparse.BooleanOptionalAction, default=True,
                        help="the reader's first step reads fetched pages where they lie in a same-host node's pool, "
                             "copying them into its blocks after the first token (on by default, as in the worker)")
    parser.add_argument("--node", default=None, metavar="HOST:PORT",
                        help="measure against this running kvnode (on another machine, say; its pages must be "
                             "the model's in --kv-dtype, and it needs room for the prompts) instead of starting one")


def run(args: argparse.Namespace) -> int:
    from worker.engine.engine import Engine
    from worker.remote.tier import Placement, RemoteTier

    if min(args.prompt_tokens, args.repeats) < 1:
        print("kvcache bench remote: error: --prompt-tokens and --repeats must be positive", file=sys.stderr)
        return 2
    try:
        page_bytes = model_page_bytes(args.model, args.kv_dtype)
        # Scheduled as a worker's engine is: the cold prompt in chunks of the default 128 tokens.
        engines = [Engine.load(args.model, kv_dtype=args.kv_dtype, kv_cache_bytes=_pool_bytes(args)) for _ in range(2)]
    except ValueError as exc:
        print(f"kvcache bench remote: error: {exc}", file=sys.stderr)
        return 2
    limit, page_tokens = engines[0].max_total_tokens, engines[0].page_tokens
    if args.prompt_tokens > limit:
        print(f"kvcache bench remote: error: --prompt-tokens {args.prompt_tokens} exceeds the model's {limit}",
              file=sys.stderr)
        return 2
    if args.prompt_tokens <= page_tokens:
        print(f"kvcache bench remote: error: --prompt-tokens {args.prompt_tokens} leaves no full page to fetch "
              f"(a page holds {page_tokens} tokens, and the last token is always computed): give more",
              file=sys.stderr)
        return 2
    serving.tune_allocator()
    pages_needed = (args.prompt_tokens // engines[0].page_tokens + 1) * (2 * args.repeats + 2)
    capacity = str(page_bytes * pages_needed)
    with _node(args.node, page_bytes, capacity) as node:
        tiers = [_TimedTier(RemoteTier(engine.kv_pool, args.kv_dtype, layerwise_fill=args.layerwise_fill,
                                       read_in_place=args.read_in_place))
                 for engine in engines]
        steps: list[dict] = []
        for engine, tier in zip(engines, tiers):
            engine.attach_remote_tier(tier)
            engine.on_step = steps.append
        placement = Placement([node.address])
        writer, reader = engines
        vocab = writer.model.config.vocab_size
        rng = np.random.default_rng(0)
        samples = {"cold": [], "warm_remote": [], "warm_local": []}
        phases: dict[str, list[dict[str, float]]] = {"warm_remote": [], "warm_local": []}
        fills = []  # ms the reader's tier spent in fill() during each warm-remote run
        fetched = []
        in_place = []  # pages the reader read where they lay in the node's pool, each warm-remote run
        try:
            _first_contact(tiers[1], placement)
            for _ in range(args.repeats):
                prompt = rng.integers(0, vocab - 1, size=args.prompt_tokens).tolist()
                cold = writer.generate(prompt, max_new_tokens=1, bypass_cache=True)[0]
                writer.generate(prompt, max_new_tokens=1, tier_context=placement)
                if not tiers[0].flush(timeout_s=60.0):
                    raise RuntimeError("write-back to the node did not finish within 60 s")
                bytes_before, fill_before = _bytes_fetched(tiers[1]), tiers[1].stats.fill_ms
                in_place_before = tiers[1].stats.pages_in_place
                warm = {}
                for name in ("warm_remote", "warm_local")[::1 if len(fills) % 2 == 0 else -1]:
                    engine, tier = (reader, tiers[1]) if name == "warm_remote" else (writer, tiers[0])
                    steps.clear()
                    tier.calls.clear()
                    warm[name] = engine.generate(prompt, max_new_tokens=1, tier_context=placement)[0]
                    phases[name].append(_phases(warm[name], steps, tier.calls))
                remote, local = warm["warm_remote"], warm["warm_local"]
                fetch_bytes = _bytes_fetched(tiers[1]) - bytes_before
                in_place.append(tiers[1].stats.pages_in_place - in_place_before)
                fills.append(tiers[1].stats.fill_ms - fill_before)
                if local.usage.cached_tokens_local != remote.usage.cached_tokens_remote:
                    raise RuntimeError(f"warm-local reused {local.usage.cached_tokens_local} tokens, warm-remote fetched "
                                       f"{remote.usage.cached_tokens_remote}: they should match; this is a bug")
                if not cold.token_ids == remote.token_ids == local.token_ids:
                    raise RuntimeError("a cache hit changed the first token: this is a bug")
                if remote.usage.cached_tokens_remote == 0:
                    raise RuntimeError("the warm run got nothing from the node: see the node and worker logs")
                samples["cold"].append(cold.usage.ttft_ms)
                samples["warm_remote"].append(remote.usage.ttft_ms)
                samples["warm_local"].append(local.usage.ttft_ms)
                fetched.append((fetch_bytes, remote.usage.cached_tokens_remote))
        finally:
            for tier in tiers:
                tier.close()
    ttft = {name: statistics.median(values) for name, values in samples.items()}
    fetch_bytes, remote_tokens = fetched[-1]
    result = {
        "bench": "remote",
        "machine": machine(),
        "options": {k: v for k, v in vars(args).items() if k != "run"},
        "page_bytes": page_bytes,
        "ttft_ms": ttft,
        "samples_ms": samples,
        "warm_remote_first": [i % 2 == 0 for i in range(args.repeats)],  # the warm runs' order in each repeat
        "cached_tokens_remote": remote_tokens,
        "kv_bytes_fetched": fetch_bytes,
        "speedup_remote_vs_cold": ttft["cold"] / ttft["warm_remote"],
        "remote_vs_local": ttft["warm_remote"] / ttft["warm_local"],
        # An upper bound on transfer time is the whole warm TTFT (it also computes the last page).
        "fetch_gb_per_s_lower_bound": fetch_bytes / (ttft["warm_remote"] / 1000) / 1e9,
        # Within that TTFT, the tier's fill: transfer and writing into the pool, overlapped.
        "fill_ms": statistics.median(fills),
        "fill_samples_ms": fills,
        "fill_gb_per_s": fetch_bytes / (statistics.median(fills) / 1000) / 1e9,
        # Where each warm run's time went (medians, ms from the request's arrival; see the docstring).
        "phases_ms": {name: _median_phases(runs) for name, runs in phases.items()},
        "phases_samples_ms": phases,
        # Layer-wise fills (issue 19): warm-remote runs that began their forward before the fill ended,
        # those sent back to wait for it (a layer late), and the layers the forward had to wait for.
        "pages_in_place": in_place,
        "layerwise": {"early_joins": reader.connector.layerwise_loads.num_early_joins, "unjoined": reader.connector.layerwise_loads.num_unjoined,
                      "layer_waits": reader.connector.layerwise_loads.num_layer_waits,
                      "discarded": reader.scheduler.remote.num_layerwise_discarded},
    }
    if args.json:
        dump_json(result)
        return 0
    print(f"{args.model}, {args.prompt_tokens}-token prompt, {args.kv_dtype} KV, pages of {page_bytes} bytes; "
          f"median of {args.repeats}")
    print_table(
        ["run", "ttft ms", "vs cold"],
        [["cold (computed)", ttft["cold"], 1.0],
         ["warm from kvnode", ttft["warm_remote"], ttft["cold"] / ttft["warm_remote"]],
         ["warm from local cache", ttft["warm_local"], ttft["cold"] / ttft["warm_local"]]],
    )
    print(f"\nwarm-from-kvnode / warm-local: {result['remote_vs_local']:.2f}x   "
          f"fetched {fetch_bytes / 2**20:.1f} MiB for {remote_tokens} tokens, "
          f">= {result['fetch_gb_per_s_lower_bound']:.2f} GB/s (whole warm TTFT counted as transfer)")
    print(f"of the warm-from-kvnode TTFT, fetching the pages and writing them into the pool took "
          f"{result['fill_ms']:.1f} ms ({result['fill_gb_per_s']:.2f} GB/s); the rest computes the last page")
    print(f"read in place (the node's pool mapped into the worker's block arena): "
          f"{sum(1 for n in in_place if n)} of {args.repeats} warm-remote runs"
          f"{'' if args.read_in_place else ' (off: --no-read-in-place)'}")
    layerwise = result["layerwise"]
    print(f"layer-wise fill {'on' if args.layerwise_fill else 'off'}: {layerwise['early_joins']} of {args.repeats} "
          f"warm-remote forwards began before their fill ended ({layerwise['unjoined']} sent back to wait, "
          f"{layerwise['layer_waits']} layer waits, {layerwise['discarded']} thrown away)")
    print("\nwhere the warm runs' time went, ms (medians of each phase; they need not add up to the median TTFT):")
    remote_phases, local_phases = result["phases_ms"]["warm_remote"], result["phases_ms"]["warm_local"]
    print_table(["phase", "warm from kvnode", "warm local"],
                [[label, remote_phases.get(key, "-"), local_phases.get(key, "-")] for key, label in _PHASES])
    return 0


_PHASES = [  # (key, label) in the order they happen
    ("lookup", "arrival -> the kvnode answered the lookup"),
    ("to_fill", "-> the fill began (the request parked)"),
    ("fill", "the fill (transfer or pins, check, into the pool)"),
    ("to_forward", "-> the forward began"),
    ("forward", "the forward of the last tokens"),
    ("to_token", "-> the first token"),
    ("ttft", "time to first token"),
]


class _TimedTier:
    """A remote tier that notes when each of its lookups and fills ran (Unix seconds, as the
    engine's step records), for the breakdown; everything else goes to the tier it wraps."""

    def __init__(self, tier):
        self.tier = tier
        self.calls: list[tuple[str, float, float]] = []  # (what, started, ended)
        self._unix_offset = time.time() - time.monotonic()  # as the engine converts its monotonic times

    def __getattr__(self, name):
        return getattr(self.tier, name)

    def lookup(self, keys, context) -> int:
        return self._timed("lookup", self.tier.lookup, keys, context)

    def fill(self, keys, block_ids, context) -> int:
        return self._timed("fill", self.tier.fill, keys, block_ids, context)

    def fill_layerwise(self, keys, block_ids, context, landed) -> int:
        return self._timed("fill", self.tier.fill_layerwise, keys, block_ids, context, landed)

    def fill_in_place(self, keys, block_ids, context):
        return self._timed("fill", self.tier.fill_in_place, keys, block_ids, context)

    def _timed(self, what: str, call, *args):
        started = time.monotonic()
        try:
            return call(*args)
        finally:
            self.calls.append((what, self._unix_offset + started, self._unix_offset + time.monotonic()))


def _first_contact(tier, placement) -> None:
    """The reader meets the node before the runs are timed, as a worker that served before has:
    a lookup makes the first contact, and the node's shared pool, when it offers one, is mapped."""
    tier.lookup([bytes(16)], placement)
    with tier.nodes.use(placement.addresses) as nodes:
        for node in nodes:
            if node.client.map_shared_pool(timeout=30.0) and tier.in_place is not None:
                tier.in_place.attach_now(node)


def _bytes_fetched(tier) -> int:
    """Page bytes the tier fetched, those read in place included."""
    return tier.stats.bytes_fetched + tier.stats.pages_in_place * tier.page_bytes


def _phases(completion, steps: list[dict], calls: list[tuple[str, float, float]]) -> dict[str, float]:
    """One warm run's phases (_PHASES), in ms, from its step records and its tier's calls."""
    record = next(r for r in steps if any(q["id"] == completion.request_id and q["computed"] + q["new"] == q["prompt"]
                                          for q in r["requests"]))
    arrived = next(q["arrived"] for q in record["requests"] if q["id"] == completion.request_id)
    forward_start = record["time"] + record["schedule_ms"] / 1000.0
    forward_end = forward_start + record["forward_ms"] / 1000.0
    marks = {"lookup": max((end for what, _, end in calls if what == "lookup"), default=arrived)}
    fills = [(start, end) for what, start, end in calls if what == "fill"]
    phases = {"lookup": (marks["lookup"] - arrived) * 1000.0}
    before_forward = marks["lookup"]
    if fills:
        fill_start, fill_end = fills[0][0], fills[-1][1]  # pinning in place, and the fetch when it could not
        phases.update(to_fill=(fill_start - marks["lookup"]) * 1000.0, fill=(fill_end - fill_start) * 1000.0)
        before_forward = fill_end
    phases.update(to_forward=(forward_start - before_forward) * 1000.0, forward=record["forward_ms"],
                  to_token=completion.usage.ttft_ms - (forward_end - arrived) * 1000.0, ttft=completion.usage.ttft_ms)
    return phases


def _median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key, _ in _PHASES if all(key in run for run in runs)}


@contextlib.contextmanager
def _node(address: str | None, page_bytes: int, capacity: str) -> Iterator[Daemon | SimpleNamespace]:
    """The kvnode measured: the one at `address`, else a new one on loopback, stopped at the end."""
    if address is not None:
        yield SimpleNamespace(address=address)
        return
    with Daemon("node", ["--port", "0", "--page-bytes", str(page_bytes), "--capacity", capacity]) as node:
        yield node


def _pool_bytes(args: argparse.Namespace) -> int:
    """Enough local blocks for a few prompts (the pool is in the KV dtype) without holding gigabytes."""
    pages = (args.prompt_tokens // 16 + 2) * 4
    return model_page_bytes(args.model, args.kv_dtype) * pages
