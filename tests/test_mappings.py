"""base/mappings.py: a reader of a kvnode's shared pool (the node's client, the worker's block
arena) fills its mapping's page tables before it returns, while the process's other threads go on:
Python's mmap held the GIL through MAP_POPULATE and one madvise over the whole range held the
memory-map lock, so a worker's engine step (which allocates arrays) stalled ~80 ms a GiB of the
node's pool whenever it met a node. Both ways of filling them (the kernel's advice, and reading a
byte a page where the kernel has no such advice) are tried."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from base import mappings
from kvnode.wire import shared_pool
from worker.kv.block_arena import BlockArena

pytestmark = pytest.mark.skipif(not shared_pool.supported(), reason="the shared pool needs Linux (memfd, SO_PEERCRED)")
PAGES, PAGE_BYTES = 256, 4 << 20  # 1 GiB: populating takes tens of ms at least
_NO_FORCED_SWITCH_S = 2.0  # longer than populating 1 GiB takes, even through Python's mmap (~0.1-0.3 s here)
# Runs of the other thread wholly within the populate (runs_of_an_allocating_thread_during): one
# here a 32 MiB step (~30); 0 when the GIL is held throughout (Python's mmap with MAP_POPULATE),
# at most 1 (the allocation that waited for it) when one madvise holds the memory-map lock throughout.
MIN_RUNS = 2


def resident_bytes(address: int) -> int:
    """Rss of this process's mapping that starts at `address` (/proc/self/smaps)."""
    lines = iter(Path("/proc/self/smaps").read_text().splitlines())
    for line in lines:
        if line.split("-", 1)[0] == f"{address:x}":
            for field in lines:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError(f"no mapping starts at {address:#x}")


def runs_of_an_allocating_thread_during(call):
    """(what `call` returned, how many times another thread allocated an 8 MiB array (which
    takes the process's memory-map lock: NumPy advises huge pages for it) and slept 1 ms, wholly
    while `call` ran). The interpreter's forced GIL hand-over is put off past the call meanwhile, so
    that thread runs during it only where the call lets the GIL go itself: at the call's edges a
    forced switch could fit one run in even when the call holds the GIL throughout."""
    runs, done = [], threading.Event()

    def allocate():
        while not done.is_set():
            begun = time.monotonic()
            np.ones(1 << 20)
            runs.append((begun, time.monotonic()))
            time.sleep(0.001)

    thread = threading.Thread(target=allocate, daemon=True)
    thread.start()
    switch_interval = sys.getswitchinterval()
    try:
        while not runs:  # running before the call begins
            time.sleep(0.001)
        sys.setswitchinterval(_NO_FORCED_SWITCH_S)
        started = time.monotonic()
        result = call()
        ended = time.monotonic()
    finally:
        sys.setswitchinterval(switch_interval)
        done.set()
        thread.join(5.0)
    return result, sum(started < begun and end < ended for begun, end in runs)


@pytest.fixture(scope="module")
def pool():
    made = shared_pool.SharedPool(PAGES, PAGE_BYTES)
    yield made
    os.close(made.fd)  # the memory goes with the last mapping (the arrays, collected)


@pytest.fixture(params=["advice", "reads"])
def how(request, monkeypatch):
    """Populate by the kernel's advice, or as on a kernel without it (before 5.14)."""
    if request.param == "reads":
        monkeypatch.setattr(mappings, "_advice_works", False)
    return request.param


def test_the_nodes_client_maps_a_pool_populated_without_stalling_other_threads(pool, how):
    array, runs = runs_of_an_allocating_thread_during(lambda: shared_pool.map_read_only(pool.fd, PAGES, PAGE_BYTES))
    assert array.shape == (PAGES, PAGE_BYTES)
    assert resident_bytes(array.ctypes.data) == PAGES * PAGE_BYTES
    assert runs >= MIN_RUNS, f"another thread ran {runs} times while the pool was mapped"


def test_the_arena_maps_a_window_populated_without_stalling_other_threads(pool, how):
    arena = BlockArena.make(4, (PAGE_BYTES,), np.uint8)
    assert arena is not None
    window, runs = runs_of_an_allocating_thread_during(lambda: arena.attach(pool.fd, PAGES, PAGE_BYTES, 1))
    address = arena.all_blocks[window.first_block:].ctypes.data
    assert resident_bytes(address) == PAGES * PAGE_BYTES
    assert runs >= MIN_RUNS, f"another thread ran {runs} times while the window was mapped"
    arena.detach(window)
