"""The KV connector: the remote tier's lookups and fetches off the engine's thread.

The scheduler talks to it through a narrow interface, after vLLM's KV connector: how many pages
past the local hits the tier holds (`get_num_matched_pages`, None while the lookup is in
flight), start loading them into blocks it allocated (`start_load`), which loads have landed
(`take_finished_loads`). It knows nothing of the network; the tier (worker/remote.py's
`RemoteTier`, or any object with its `lookup`, `fill` and `on_page_full`) does the I/O.

Design notes
1. Lookups run on `lookup_threads` threads, fetches on one loader thread (the tier receives one
   fill at a time into its staging buffers anyway). The engine's lock is never held while they
   run: the scheduler only submits work and reads finished results.
2. A request whose pages are being fetched is parked by the scheduler: its blocks allocated, not
   scheduled, never preempted (the loader writes into its blocks). It joins the batch in the
   first step after its load finished, with what landed counted as computed; the rest of the
   prompt is computed, so a fetch that fails or returns fewer pages costs time, never tokens.
3. Prefetch on arrival: the engine starts a request's lookup when the request is received
   (`start_lookup`, any thread), so by the time the scheduler first considers it the node has
   usually answered. A result the tier gave more than half its lease ago is asked again (its
   pages may have been evicted on the node since the lease lapsed).
4. Every wait is bounded: a lookup or load that has not finished after `timeout_s` is given
   up: the scheduler computes the request instead, and the blocks the loader may still write
   are released only when it does finish (`take_finished_loads` reports it).
5. Each finished lookup or load calls `wake` (the engine's loop sleeps on it when nothing else
   can run).
6. `close(timeout_s)` is bounded: queued work is dropped, running calls get `timeout_s` to end
   (the tier's own deadlines end them sooner), and what is asked of a closed connector is
   answered at once as a miss, so a step that races the close never waits for it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

log = logging.getLogger("worker.connector")

DEFAULT_TIMEOUT_S = 30.0  # a backstop: RemoteTier bounds its own calls far sooner (deadlines per call)
DEFAULT_CLOSE_TIMEOUT_S = 5.0


@dataclass
class _Lookup:
    keys: list[bytes]
    future: Future  # of (pages found, when the tier answered)
    started: float


@dataclass
class _Load:
    request: Any
    future: Future
    started: float
    blocks: list[int] = field(default_factory=list)  # once given up: to release when the loader is done


@dataclass
class FinishedLoads:
    landed: list[tuple[Any, int]] = field(default_factory=list)  # (request, leading pages that arrived)
    released: list[list[int]] = field(default_factory=list)  # blocks of loads given up, the loader done with them
    overdue: list[Any] = field(default_factory=list)  # requests whose load ran past timeout_s

    def __bool__(self) -> bool:
        return bool(self.landed or self.released or self.overdue)


class KVConnector:
    def __init__(self, tier, lookup_threads: int = 4, timeout_s: float = DEFAULT_TIMEOUT_S,
                 wake: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic):
        self.tier = tier
        self.timeout_s = timeout_s
        self.wake = wake
        self.clock = clock
        lease_ms = getattr(tier, "lease_ms", None)
        self.max_lookup_age_s = lease_ms / 2000.0 if lease_ms else None
        self._lookups: dict[int, _Lookup] = {}  # id(request) ->; the request is held by the engine meanwhile
        self._loads: dict[int, _Load] = {}  # id(request) -> its load
        self._detached: list[_Load] = []  # loads given up, still running
        self._lock = threading.Lock()  # start_lookup runs on callers' threads
        self._lookup_pool = ThreadPoolExecutor(lookup_threads, thread_name_prefix="kv-lookup")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        self._running: set[Future] = set()  # submitted and not done, for a bounded close
        self._closed = False
        self._pools_lock = threading.Lock()  # guards the two above; taken after _lock, never before
        self.num_lookups_given_up = 0
        self.num_loads_given_up = 0

    # ---- any thread -------------------------------------------------------------

    def start_lookup(self, request, keys: Sequence[bytes]) -> None:
        """Ask the tier about `keys` (the request's reusable chain) now, on a lookup thread."""
        if not keys:
            return
        keys = list(keys)
        with self._lock:
            if id(request) in self._lookups:
                return
            self._lookups[id(request)] = _Lookup(keys, self._submit_lookup(keys, request.tier_context), self.clock())

    def close(self, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> bool:
        """Stop taking work, drop what is queued, give running calls `timeout_s` to end (design
        note 6); False, with one log line, when some still run then (their threads end with
        the tier's deadlines)."""
        with self._pools_lock:
            self._closed = True
            running = list(self._running)
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        self._loader.shutdown(wait=False, cancel_futures=True)
        _, not_done = wait(running, timeout=timeout_s)
        if not_done:
            log.warning("KV connector closed with %d remote calls still running after %.1fs; "
                        "they end with the remote tier's deadlines", len(not_done), timeout_s)
            return False
        self._lookup_pool.shutdown(wait=True)  # every thread is idle: they exit at once
        self._loader.shutdown(wait=True)
        return True

    # ---- the scheduler (under the engine's lock) -------------------------------------

    def get_num_matched_pages(self, request, keys: Sequence[bytes], local_blocks: Sequence[int]) -> int | None:
        """How many of `keys`, from the first, the tier holds (local hits included), or None while
        its lookup is in flight. The tier is handed the local pages it lacks (`local_blocks` are
        the blocks of the locally cached keys), so their children will not be refused there."""
        with self._lock:
            lookup = self._lookups.get(id(request))
            now = self.clock()
            stale = lookup is not None and lookup.future.done() and not lookup.future.cancelled() and (
                lookup.keys != list(keys) or (self.max_lookup_age_s is not None
                                              and now - lookup.future.result()[1] > self.max_lookup_age_s))
            if lookup is None or stale:
                lookup = _Lookup(list(keys), self._submit_lookup(list(keys), request.tier_context), now)
                self._lookups[id(request)] = lookup
            if not lookup.future.done():
                if now - lookup.started < self.timeout_s:
                    return None
                self.num_lookups_given_up += 1
                log.warning("remote lookup for request %s still running after %.0fs; computing instead",
                            request.request_id, self.timeout_s)
                found = 0
            else:
                found = 0 if lookup.future.cancelled() else lookup.future.result()[0]
            del self._lookups[id(request)]
        if found < len(local_blocks):
            self._write_back(request, keys, local_blocks, found)
        return found

    def peek_matched_pages(self, request) -> int | None:
        """What the request's lookup found, if it answered (nothing is consumed or started)."""
        lookup = self._lookups.get(id(request))
        if lookup is None or not lookup.future.done() or lookup.future.cancelled():
            return None
        return lookup.future.result()[0]

    def is_looking_up(self, request) -> bool:
        lookup = self._lookups.get(id(request))
        return lookup is not None and not lookup.future.done()

    def start_load(self, request, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Fetch `keys` into `block_ids` (allocated by the scheduler, not scheduled until the load ends)."""
        future = self._submit(self._loader, 0, self._fill, list(keys), list(block_ids), request.tier_context)
        self._loads[id(request)] = _Load(request, future, self.clock())

    def take_finished_loads(self) -> FinishedLoads:
        """Loads that ended since the last call, those that let go of blocks given up before,
        and requests whose load has run past `timeout_s` (design note 4)."""
        finished, now = FinishedLoads(), self.clock()
        for key, load in list(self._loads.items()):
            if load.future.done():
                del self._loads[key]
                finished.landed.append((load.request, 0 if load.future.cancelled() else load.future.result()))
            elif now - load.started >= self.timeout_s:
                finished.overdue.append(load.request)
        for load in list(self._detached):
            if load.future.done():
                self._detached.remove(load)
                finished.released.append(load.blocks)
        return finished

    def give_up_load(self, request, blocks: Sequence[int]) -> None:
        """The request no longer waits for its load (it ended, or the load is overdue); `blocks`
        (those the loader may write) come back in `released` once the loader let go of them."""
        load = self._loads.pop(id(request))
        load.blocks = list(blocks)
        self._detached.append(load)
        self.num_loads_given_up += 1

    def forget(self, request) -> None:
        """The request ended: drop its lookup (a running one finishes unread)."""
        with self._lock:
            self._lookups.pop(id(request), None)

    def num_lookups_in_flight(self) -> int:
        with self._lock:
            return sum(1 for lookup in self._lookups.values() if not lookup.future.done())

    def num_pending(self) -> int:
        """Lookups and loads not yet taken by the scheduler (loads given up included)."""
        return len(self._lookups) + len(self._loads) + len(self._detached)

    def on_page_full(self, key: bytes, parent_key: bytes, block_id: int, context: Any) -> None:
        try:
            self.tier.on_page_full(key, parent_key, block_id, context)
        except Exception:  # a tier never fails a request
            log.exception("remote tier on_page_full failed")

    # ---- internals --------------------------------------------------------------------

    def _write_back(self, request, keys: Sequence[bytes], local_blocks: Sequence[int], start: int) -> None:
        for page in range(start, len(local_blocks)):
            try:
                self.tier.on_page_full(keys[page], keys[page - 1] if page else b"", local_blocks[page],
                                       request.tier_context)
            except Exception:  # a tier never fails a request
                log.exception("remote tier on_page_full failed for request %s", request.request_id)
                return

    def _submit_lookup(self, keys: list[bytes], context: Any) -> Future:
        return self._submit(self._lookup_pool, (0, self.clock()), self._lookup, keys, context)

    def _submit(self, pool: ThreadPoolExecutor, when_closed: Any, fn, *args) -> Future:
        """`fn(*args)` on `pool`; once closed, a future already holding `when_closed` (a miss)."""
        with self._pools_lock:
            if self._closed:
                future: Future = Future()
                future.set_result(when_closed)
                return future
            future = pool.submit(fn, *args)
            self._running.add(future)

        def done(_):
            with self._pools_lock:
                self._running.discard(future)
            self.wake()

        future.add_done_callback(done)
        return future

    def _lookup(self, keys: list[bytes], context: Any) -> tuple[int, float]:
        try:
            found = int(self.tier.lookup(keys, context))
        except Exception:
            log.exception("remote tier lookup failed; computing instead")
            found = 0
        return max(0, min(found, len(keys))), self.clock()

    def _fill(self, keys: list[bytes], block_ids: list[int], context: Any) -> int:
        try:
            filled = int(self.tier.fill(keys, block_ids, context))
        except Exception:
            log.exception("remote tier fill failed; computing instead")
            filled = 0
        return max(0, min(filled, len(keys)))
