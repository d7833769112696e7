"""`kvcache bench persistence`: the kvnode's disk tier (--data-dir). Two figures, each beside
its baseline in the same run:

1. Fetch: pages read through the store from its disk tier (read into RAM, promoted) in GB/s,
   under each disk check (`start`, the node's default: the slot's header checked; `always`: its
   checksum too), beside the RAM tier's reads and a plain os.preadv of the same bytes from the
   same file, with the file in the OS page cache (goal: disk tier >= 0.7 of the plain read).
   Plain and disk passes alternate, so a shared machine's load weighs on both alike; the best
   of each is reported, the median of the rounds' ratios, and the median thread CPU time a
   page (which other processes' load disturbs far less than wall time). Then the same pages
   fetched over the data plane (GET on a real socket) from the disk tier beside the RAM tier.
2. Restart: a real `kvcache node` started on a data dir holding --restart-size of pages, the
   seconds until it serves (its "listening" line; every page checked by then) (goal: < 3 s),
   beside the store's recovery alone in this process.
The data dir is a temporary folder under --dir (default: the system's temporary folder).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from base.units import parse_size
from kvcache.bench.report import dump_json, machine, print_table
from kvcache.launch import Daemon
from kvnode.client import NodeClient
from kvnode.client.data_client import DataPlaneClient
from kvnode.data_plane.server import DataPlaneServer
from kvnode.disk.tier import CHECK_ALWAYS, CHECK_AT_START, HEADER_BYTES, DiskTier
from kvnode.store.page_store import PageStore

TINY_FP32_PAGE = 4 * 2 * 4 * 16 * 64 * 4  # 131,072 bytes: the default node page


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page-bytes", type=int, default=TINY_FP32_PAGE, help="page size (default %(default)s)")
    parser.add_argument("--fetch-size", default="256MiB", help="bytes of pages read per fetch pass (default 256MiB)")
    parser.add_argument("--rounds", type=int, default=5, help="fetch passes per path, best kept (default 5)")
    parser.add_argument("--pages-per-batch", type=int, default=16, help="pages per store read (default 16)")
    parser.add_argument("--restart-size", default="1GiB", help="pages on disk for the restart (default 1GiB)")
    parser.add_argument("--dir", default=None, help="where the temporary data dir goes (default: system temp)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args: argparse.Namespace) -> int:
    try:
        fetch_pages = parse_size(args.fetch_size) // args.page_bytes
        restart_pages = parse_size(args.restart_size) // args.page_bytes
        if min(fetch_pages, restart_pages, args.rounds, args.pages_per_batch) < 1:
            raise ValueError("--fetch-size and --restart-size must hold a page; --rounds, --pages-per-batch >= 1")
    except ValueError as exc:
        print(f"kvcache bench persistence: error: {exc}", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="kvcache-bench-disk-", dir=args.dir))
    try:
        fetch = measure_fetch(folder / "fetch", args.page_bytes, fetch_pages, args.rounds, args.pages_per_batch)
        restart = measure_restart(folder / "restart", args.page_bytes, restart_pages)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {"bench": "persistence", "machine": machine(),
              "options": {k: v for k, v in vars(args).items() if k != "run"}, "fetch": fetch, "restart": restart}
    if args.json:
        dump_json(result)
        return 0
    print(f"fetch: {fetch['pages']} pages of {args.page_bytes} bytes, batches of {args.pages_per_batch}, "
          f"best of {args.rounds}, file in the page cache")
    names = {"plain_read": "plain_read", "disk_tier": f"disk_tier (--disk-check {CHECK_AT_START}, default)",
             "disk_tier_always": f"disk_tier (--disk-check {CHECK_ALWAYS})", "ram_tier": "ram_tier"}
    print_table(["path", "GB/s", "x plain read", "per-round median", "thread CPU us/page", "x plain CPU"],
                [[label, f"{fetch[name]:.2f}", f"{fetch[name] / fetch['plain_read']:.2f}",
                  f"{fetch[name + '_paired_ratio']:.2f}" if name.startswith("disk") else "",
                  f"{fetch[name + '_cpu_us']:.1f}" if name != "ram_tier" else "",
                  f"{fetch['plain_read_cpu_us'] / fetch[name + '_cpu_us']:.2f}" if name != "ram_tier" else ""]
                 for name, label in names.items()])
    print("per-round median: the disk pass over the plain read right before it; x plain CPU: the plain read's "
          "thread CPU a page over the path's")
    print(f"over the data plane (GET, one connection): pages on disk {fetch['data_plane_disk']:.2f} GB/s, "
          f"the same pages in RAM {fetch['data_plane_ram']:.2f} GB/s; disk / RAM per round, median: "
          f"{fetch['data_plane_paired_ratio']:.2f}")
    print(f"goal: disk tier (default check) >= 0.7x the plain read: "
          f"{'met' if fetch['disk_tier'] >= 0.7 * fetch['plain_read'] else 'NOT met'} in the bests, "
          f"{'met' if fetch['disk_tier_paired_ratio'] >= 0.7 else 'NOT met'} in the per-round median")
    print(f"restart: {restart['pages']} pages ({restart['bytes'] / 2**30:.2f} GiB) on disk; a node serves again after "
          f"{restart['node_serving_s']:.2f}s (recovery {restart['node_recovery_s']:.2f}s of it; "
          f"in-process recovery alone {restart['store_recovery_s']:.2f}s)")
    print(f"goal: serving again in under 3 s: {'met' if restart['node_serving_s'] < 3.0 else 'NOT met'}")
    return 0


def fill(folder: Path, page_bytes: int, pages: int, ram_pages: int) -> PageStore:
    """A store on a new disk tier holding `pages` pages in chains of 64, all written to disk."""
    folder.mkdir(parents=True, exist_ok=True)
    store = PageStore(ram_pages, page_bytes, disk=DiskTier(folder, pages, page_bytes))
    data = np.random.default_rng(0).integers(0, 256, size=page_bytes, dtype=np.uint8)
    parent = b""
    for n in range(pages):
        key = n.to_bytes(16, "little") if n else b"\x01" * 16  # never all zero
        store.put(key, b"" if n % 64 == 0 else parent, data)
        parent = key
    store.flush()
    return store


def measure_fetch(folder: Path, page_bytes: int, pages: int, rounds: int, per_batch: int) -> dict:
    store = fill(folder, page_bytes, pages, ram_pages=per_batch)
    keys = store.keys()
    batches = [keys[i : i + per_batch] for i in range(0, len(keys), per_batch)]
    total = len(keys) * page_bytes
    # The same file under the other check: recovered afresh, so every page is on disk only.
    always = PageStore(per_batch, page_bytes, disk=DiskTier(folder, pages, page_bytes, check=CHECK_ALWAYS))

    def store_pass(on: PageStore) -> tuple[float, float]:
        """(GB/s, thread CPU us a page)."""
        started, cpu = time.perf_counter(), time.thread_time()
        for batch in batches:
            on.pin_pages(batch)
            on.unpin_pages(batch)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - started
        return total / wall / 1e9, cpu / len(keys) * 1e6

    slots = [store._index[k].disk_slot for k in keys]  # the bench measures internals (docs/architecture.md)
    path, slot_bytes = store.disk.path, store.disk.slot_bytes
    buffer = bytearray(page_bytes * per_batch)
    views = [memoryview(buffer)[i * page_bytes : (i + 1) * page_bytes] for i in range(per_batch)]

    def plain_pass() -> tuple[float, float]:
        fd = os.open(path, os.O_RDONLY)
        try:
            started, cpu = time.perf_counter(), time.thread_time()
            for first in range(0, len(slots), per_batch):
                for view, slot in zip(views, slots[first : first + per_batch]):
                    os.preadv(fd, [view], slot * slot_bytes + HEADER_BYTES)
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - started
            return total / wall / 1e9, cpu / len(keys) * 1e6
        finally:
            os.close(fd)

    plain_pass()  # the file into the page cache
    # Interleaved, the order of the two checks taking turns: each pass beside its plain read, under the same load.
    runs: dict[str, list[tuple[float, float]]] = {"plain_read": [], "disk_tier": [], "disk_tier_always": []}
    ratios: dict[str, list[float]] = {"disk_tier": [], "disk_tier_always": []}
    for number in range(rounds):
        order = [("disk_tier", store), ("disk_tier_always", always)]
        for name, on in order if number % 2 == 0 else reversed(order):
            plain = plain_pass()
            runs["plain_read"].append(plain)
            runs[name].append(store_pass(on))
            ratios[name].append(runs[name][-1][0] / plain[0])
    out: dict = {}
    for name, figures in runs.items():
        out[name] = max(rate for rate, _ in figures)
        out[name + "_cpu_us"] = float(np.median([cpu for _, cpu in figures]))
    for name, values in ratios.items():
        out[name + "_paired_ratio"] = float(np.median(values))
    always.disk.close()
    disk_store = store
    ram_store = PageStore(pages, page_bytes, disk=DiskTier(folder, pages, page_bytes))  # RAM holds them all
    for batch in batches:
        ram_store.read(batch)  # promote every page
    out["ram_tier"] = max(store_pass(ram_store)[0] for _ in range(rounds))
    try:
        wire = measure_data_plane(disk_store, ram_store, batches, page_bytes, rounds)
    finally:
        disk_store.disk.close()
        ram_store.disk.close()
    return {"pages": len(keys), "disk_check": CHECK_AT_START, **out, **wire}


def measure_data_plane(disk_store: PageStore, ram_store: PageStore, batches: list, page_bytes: int,
                       rounds: int) -> dict:
    """GETs over the data plane (a real socket, this process at both ends) of pages on disk only
    beside the same pages in RAM, passes interleaved: what a disk-tier hit costs a fetch."""
    servers = [DataPlaneServer(s, "127.0.0.1", 0).start() for s in (disk_store, ram_store)]
    clients = [DataPlaneClient("127.0.0.1", server.port) for server in servers]
    out = memoryview(bytearray(page_bytes * len(batches[0])))
    sums = memoryview(bytearray(16 * len(batches[0])))  # received, not checked: the node's cost is measured
    total = sum(len(batch) for batch in batches) * page_bytes

    def get_pass(client: DataPlaneClient) -> float:
        started = time.perf_counter()
        for batch in batches:
            client.get_into(batch, out[: len(batch) * page_bytes], sums[: len(batch) * 16], timeout_s=60.0)
        return total / (time.perf_counter() - started) / 1e9

    try:
        pairs = [(get_pass(clients[1]), get_pass(clients[0])) for _ in range(rounds)]
    finally:
        for client, server in zip(clients, servers):
            client.close()
            server.stop()
    return {"data_plane_ram": max(r for r, _ in pairs), "data_plane_disk": max(d for _, d in pairs),
            "data_plane_paired_ratio": float(np.median([d / r for r, d in pairs]))}


def measure_restart(folder: Path, page_bytes: int, pages: int) -> dict:
    store = fill(folder, page_bytes, pages, ram_pages=64)
    store.disk.close()
    started = time.perf_counter()
    again = PageStore(64, page_bytes, disk=DiskTier(folder, pages, page_bytes))
    store_recovery = time.perf_counter() - started
    assert again.num_used() == pages, f"recovered {again.num_used()} of {pages} pages"
    again.disk.close()
    (folder / "layout.json").write_text(f'{{"page_bytes": {page_bytes}}}\n')
    started = time.perf_counter()
    with Daemon("node", ["--host", "127.0.0.1", "--port", "0", "--page-bytes", str(page_bytes),
                         "--capacity", str(64 * page_bytes), "--disk-capacity", str(pages * page_bytes),
                         "--data-dir", str(folder)]) as daemon:
        serving = time.perf_counter() - started
        with NodeClient(daemon.address) as client:
            assert client.info().used_pages == pages
            recovery_ms = client.stats()["recovery_ms"]
    return {"pages": pages, "bytes": pages * page_bytes, "store_recovery_s": store_recovery,
            "node_serving_s": serving, "node_recovery_s": recovery_ms / 1000}
