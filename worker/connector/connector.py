"""The KV connector: the remote tier's lookups and fetches off the engine's thread.

The scheduler and the engine see it as `Connector` (below), after vLLM's KV connector: its
`lookups` say how many pages of a chain the tier holds (None while the lookup is in flight), it
starts loading them into blocks the scheduler allocated (`start_load`) and says which loads have
landed (`take_finished_loads`); its `layerwise_loads` let a request run before its layer-wise load
ended. It knows nothing of the network; a `Tier` (worker/remote/tier.py's RemoteTier over kvnodes)
does the I/O.

Lookups run on `lookup_threads` threads, fetches on one loader thread (the tier receives one fill
at a time into its staging buffers anyway). The engine's lock is never held while they run: the
scheduler only submits work and reads finished results, and each finished lookup or load calls
`wake` (the engine's loop sleeps on it when nothing else can run).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Protocol, Sequence

from worker.connector.layers import LayerwiseLoads
from worker.connector.loads import FinishedLoads, Landed, LayerwiseLoad, Load, Loads
from worker.connector.lookups import TierLookups
from worker.kv.pages_in_place import PagesInPlace

log = logging.getLogger("worker.connector")

DEFAULT_TIMEOUT_S = 30.0  # a backstop: RemoteTier bounds its own calls far sooner (deadlines per call)
DEFAULT_CLOSE_WAIT_S = 5.0
DEFAULT_LAYER_WAIT_S = 0.1  # the engine's wait for one layer of a layer-wise load (layers.py: why short)
DEFAULT_STEP_WAIT_S = 0.3  # ... and for all the layers of its early step together
DEFAULT_SETTLE_TIMEOUT_S = 1.0  # ... and for its outcome once its last layer landed


class Tier:
    """A second cache level behind the local prefix cache (worker/remote/tier.py's RemoteTier over
    kvnodes), called on the connector's threads. `context` is the request's opaque `tier_context`
    (e.g. its placement); the tier reads and writes the engine's pool array in the page layout.
    A tier implements the first three methods; the abilities after them are off unless it offers them."""

    lease_ms: int | None = None  # its lookups lease pages this long: older answers are asked again (Lookups)
    layerwise_fill: bool = False  # loads use fill_layerwise (worker/connector/layers.py)

    def lookup(self, keys: Sequence[bytes], context: Any) -> int:
        """How many of these page keys (a request's chain, from its first page) do you hold?"""
        raise NotImplementedError

    def fill(self, keys: Sequence[bytes], block_ids: Sequence[int], context: Any) -> int:
        """Write page keys[i] into block block_ids[i], in order; how many were really filled."""
        raise NotImplementedError

    def on_page_full(self, key: bytes, parent_key: bytes, block_id: int, context: Any) -> None:
        """A page became full (parent_key b"" for a first page); copy it now, without blocking."""
        raise NotImplementedError

    def fill_in_place(self, keys: Sequence[bytes], block_ids: Sequence[int], context: Any) -> PagesInPlace | None:
        """All of `keys` pinned where they lie in a same-host node's pool, meant for `block_ids`, to be
        read there for one step and then copied (worker/kv/pages_in_place.py); None: `fill` them."""
        return None

    def fill_layerwise(self, keys: Sequence[bytes], block_ids: Sequence[int], context: Any,
                       landed: Callable[[int], None]) -> int:
        """As `fill`, calling landed(l) once layer l of every page is in the pool (layers.py)."""
        raise NotImplementedError


class Lookups(Protocol):
    """How many pages of a request's chain, from the first, the tier holds (lookups.py's TierLookups)."""

    def start(self, request, keys: Sequence[bytes]) -> None: ...  # no-op while a fresh answer stands
    def take(self, request) -> int | None: ...  # None while in flight; the answer is taken once
    def peek(self, request) -> int | None: ...  # the answer, if any, left in place
    def in_flight(self, request) -> bool: ...


class LayerwiseJoins(Protocol):
    """Parked requests running a step before their layer-wise load ended (layers.py's LayerwiseLoads)."""

    def can_join_early(self, request) -> bool: ...
    def join_early(self, request) -> None: ...
    def unjoin(self, request) -> None: ...
    def wait_layer(self, request, layer: int) -> bool: ...  # the engine, before computing `layer`
    def settle(self, request, blocks: Sequence[int], wait_s: float | None = None) -> int | None: ...


class Connector(Protocol):
    """What the scheduler and the engine use of a connector; none of it waits on the network, but
    for the bounded waits of a layer-wise join."""

    timeout_s: float  # a lookup or load not done this long after it was asked for is given up

    @property
    def lookups(self) -> Lookups: ...  # the engine starts them on arrival, the scheduler takes them at admission
    @property
    def layerwise_loads(self) -> LayerwiseJoins: ...

    # The scheduler, under the engine's lock (worker/engine/remote_joins.py).
    def start_load(self, request, keys: Sequence[bytes], block_ids: Sequence[int]) -> None: ...
    def take_finished_loads(self) -> FinishedLoads: ...
    def drop(self, request, blocks: Sequence[int] = ()) -> None: ...
    def write_back(self, request, keys: Sequence[bytes], local_blocks: Sequence[int], start: int) -> None: ...
    def on_page_full(self, key: bytes, parent_key: bytes, block_id: int, context: Any) -> None: ...

    # The engine.
    def has_releases(self) -> bool: ...
    def num_pending(self) -> int: ...
    def close(self, wait_s: float = DEFAULT_CLOSE_WAIT_S) -> bool: ...


class KVConnector:
    """The Connector over a Tier, its calls on threads of its own."""

    def __init__(self, tier: Tier, lookup_threads: int = 4, timeout_s: float = DEFAULT_TIMEOUT_S,
                 wake: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic,
                 layer_wait_s: float = DEFAULT_LAYER_WAIT_S, settle_timeout_s: float = DEFAULT_SETTLE_TIMEOUT_S,
                 step_wait_s: float = DEFAULT_STEP_WAIT_S):
        self.tier = tier
        self.wake = wake
        self.clock = clock
        self._loads = Loads(clock, timeout_s)
        self.layerwise_loads = LayerwiseLoads(self._loads, layer_wait_s, step_wait_s, settle_timeout_s)  # layers.py
        self._lookup_pool = ThreadPoolExecutor(lookup_threads, thread_name_prefix="kv-lookup")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        self._running: set[Future] = set()  # submitted and not done, for a bounded close
        self._closed = False
        self._pools_lock = threading.Lock()  # guards the two above; taken after the lookups' lock, never before
        self.lookups = TierLookups(tier, lambda fn, *args: self._submit(self._lookup_pool, (0, self.clock()), fn, *args),
                                   clock, tier.lease_ms, timeout_s)

    @property
    def timeout_s(self) -> float:
        return self._loads.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._loads.timeout_s = self.lookups.timeout_s = value

    @property
    def num_loads_given_up(self) -> int:
        return self._loads.num_given_up

    @property
    def num_loads_cancelled(self) -> int:
        """... of which had not started: never run (Loads.give_up)."""
        return self._loads.num_cancelled

    # ---- any thread -------------------------------------------------------------

    def close(self, wait_s: float = DEFAULT_CLOSE_WAIT_S) -> bool:
        """Stop taking work, drop what is queued, give running calls `wait_s` to end; False, with
        one log line, when some still run then (their threads end with the tier's deadlines, far
        sooner). What is asked of a closed connector is answered at once as a miss (_submit), so a
        step that races the close never waits for it."""
        with self._pools_lock:
            self._closed = True
            running = list(self._running)
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        self._loader.shutdown(wait=False, cancel_futures=True)
        _, not_done = wait(running, timeout=wait_s)
        self._loads.release_in_place()
        if not_done:
            log.warning("KV connector closed with %d remote calls still running after %.1fs; "
                        "they end with the remote tier's deadlines", len(not_done), wait_s)
            return False
        self._lookup_pool.shutdown(wait=True)  # every thread is idle: they exit at once
        self._loader.shutdown(wait=True)
        return True

    # ---- the scheduler (under the engine's lock) -------------------------------------

    def write_back(self, request, keys: Sequence[bytes], local_blocks: Sequence[int], start: int) -> None:
        """Hand the tier the local pages it lacks, keys[start:] held in `local_blocks` (those of the
        locally cached keys), so their children will not be refused there; stops at a failure."""
        for page in range(start, len(local_blocks)):
            try:
                self.tier.on_page_full(keys[page], keys[page - 1] if page else b"", local_blocks[page],
                                       request.tier_context)
            except Exception:  # a tier never fails a request
                log.exception("remote tier on_page_full failed for request %s", request.request_id)
                return

    def start_load(self, request, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Fetch `keys` into `block_ids` (allocated by the scheduler, not scheduled until the load ends).

        The request is parked meanwhile: its blocks held, never preempted (the loader writes into
        them). It joins the batch in the first step after its load finished, with what landed counted
        as computed and the rest of the prompt computed, so a fetch that fails or brings fewer pages
        costs time, never tokens."""
        if self.tier.layerwise_fill:  # layer by layer: the request may join a step before the load ends (layers.py)
            layers = LayerwiseLoad(self.wake)
            future = self._submit(self._loader, Landed(), self._fill_layerwise, list(keys), list(block_ids),
                                  request.tier_context, layers)
            future.add_done_callback(lambda _: layers.end())  # also when closed or cancelled
        else:
            layers = None
            future = self._submit(self._loader, Landed(), self._fill, list(keys), list(block_ids), request.tier_context)
        self._loads.add(Load(request, future, self.clock(), layers=layers))

    def take_finished_loads(self) -> FinishedLoads:
        """Loads that ended since the last call, those that let go of blocks given up before,
        and requests whose load has run past `timeout_s`. Every wait is bounded: a load not finished
        `timeout_s` after it was asked for, time queued behind other loads included, is overdue and
        the scheduler computes its request instead. A load joined early is not among them: its step
        settles it (LayerwiseLoads.settle)."""
        return self._loads.take_finished_loads()

    def drop(self, request, blocks: Sequence[int] = ()) -> None:
        """The request no longer waits for the tier (it ended, or its load is overdue): its lookup is
        dropped (a running one finishes unread) and its load, if any, given up (Loads.give_up)."""
        self.lookups.drop(request)
        if self._loads.get(request) is not None:
            self._loads.give_up(request, blocks)

    def has_releases(self) -> bool:
        """Loads given up that let go of their blocks: the next take_finished_loads releases them."""
        return self._loads.has_releases()

    def num_pending(self) -> int:
        """Lookups and loads not yet taken by the scheduler (loads given up included)."""
        return len(self.lookups) + len(self._loads)

    def on_page_full(self, key: bytes, parent_key: bytes, block_id: int, context: Any) -> None:
        try:
            self.tier.on_page_full(key, parent_key, block_id, context)
        except Exception:  # a tier never fails a request
            log.exception("remote tier on_page_full failed")

    # ---- internals --------------------------------------------------------------------

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

    def _fill_layerwise(self, keys: list[bytes], block_ids: list[int], context: Any, layers: LayerwiseLoad) -> Landed:
        try:
            filled = int(self.tier.fill_layerwise(keys, block_ids, context, layers.land))
        except Exception:
            log.exception("remote tier layer-wise fill failed; computing instead")
            filled = 0
        return Landed(max(0, min(filled, len(keys))))

    def _fill(self, keys: list[bytes], block_ids: list[int], context: Any) -> Landed:
        """How many leading pages landed in `block_ids`, or the pages pinned in place (Tier.fill_in_place),
        asked for first; pinned but fewer than all, they go back and the pages are fetched."""
        try:
            pages = self.tier.fill_in_place(keys, block_ids, context)
        except Exception:
            log.exception("remote tier fill in place failed; fetching the pages instead")
            pages = None
        if pages is not None:
            if len(pages) == len(keys):
                return Landed(len(pages), pages)
            pages.release()
        try:
            filled = int(self.tier.fill(keys, block_ids, context))
        except Exception:
            log.exception("remote tier fill failed; computing instead")
            filled = 0
        return Landed(max(0, min(filled, len(keys))))

