"""The KV connector's lookups (its `lookups`, the `Lookups` interface in connector.py): how many pages
of a request's chain the tier holds, asked on the connector's lookup threads from the request's
arrival and taken when the scheduler admits it (KVConnector.take_finished_loads: the bound on every
wait)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

log = logging.getLogger("worker.connector")  # its messages are the connector's


@dataclass
class _Lookup:
    keys: list[bytes]
    future: Future  # of (pages found, when the tier answered)
    started: float


class TierLookups:
    """The lookups of requests not admitted yet, by request; any thread may start one."""

    def __init__(self, tier, submit: Callable[..., Future], clock: Callable[[], float], lease_ms: int | None,
                 timeout_s: float):
        self.tier = tier
        self.clock = clock
        self.timeout_s = timeout_s  # a lookup in flight this long is given up: a miss
        self.max_age_s = lease_ms / 2000.0 if lease_ms else None  # half a lease: older answers are asked again
        self.num_given_up = 0
        self._submit = submit  # submit(fn, *args): fn(*args) on a lookup thread; a miss once closed
        self._lookups: dict[int, _Lookup] = {}  # id(request) ->; the request is held by the engine meanwhile
        self._lock = threading.Lock()  # start runs on callers' threads

    def start(self, request, keys: Sequence[bytes]) -> None:
        """Ask the tier about `keys` (the request's reusable chain) on a lookup thread, unless its
        lookup of these keys runs or answered less than half a lease ago (the pages of an older
        answer may have been evicted since its lease lapsed). The engine starts it as the request
        arrives, so the node has usually answered by the time the scheduler admits it."""
        if not keys:
            return
        keys = list(keys)
        with self._lock:
            lookup = self._lookups.get(id(request))
            now = self.clock()
            if lookup is not None and not self._stale(lookup, keys, now):
                return
            self._lookups[id(request)] = _Lookup(keys, self._submit(self._lookup, keys, request.tier_context), now)

    def take(self, request) -> int | None:
        """How many of the keys its lookup was started with, from the first, the tier holds, or None
        while it is in flight; 0 once it has run `timeout_s`, or when none was started. An answer is
        taken once."""
        with self._lock:
            lookup = self._lookups.get(id(request))
            if lookup is None:
                return 0
            if not lookup.future.done():
                if self.clock() - lookup.started < self.timeout_s:
                    return None
                self.num_given_up += 1
                log.warning("remote lookup for request %s still running after %.0fs; computing instead",
                            request.request_id, self.timeout_s)
                found = 0
            else:
                found = 0 if lookup.future.cancelled() else lookup.future.result()[0]
            del self._lookups[id(request)]
        return found

    def peek(self, request) -> int | None:
        """What the request's lookup found, if it answered (nothing is consumed or started)."""
        lookup = self._lookups.get(id(request))
        if lookup is None or not lookup.future.done() or lookup.future.cancelled():
            return None
        return lookup.future.result()[0]

    def in_flight(self, request) -> bool:
        lookup = self._lookups.get(id(request))
        return lookup is not None and not lookup.future.done()

    def drop(self, request) -> None:
        """Forget the request's lookup (a running one finishes unread)."""
        with self._lock:
            self._lookups.pop(id(request), None)

    def num_in_flight(self) -> int:
        with self._lock:
            return sum(1 for lookup in self._lookups.values() if not lookup.future.done())

    def __len__(self) -> int:
        return len(self._lookups)

    def _stale(self, lookup: _Lookup, keys: list[bytes], now: float) -> bool:
        """An answer for other keys, or older than half a lease."""
        return lookup.future.done() and not lookup.future.cancelled() and (
            lookup.keys != keys or (self.max_age_s is not None and now - lookup.future.result()[1] > self.max_age_s))

    def _lookup(self, keys: list[bytes], context: Any) -> tuple[int, float]:
        try:
            found = int(self.tier.lookup(keys, context))
        except Exception:
            log.exception("remote tier lookup failed; computing instead")
            found = 0
        return max(0, min(found, len(keys))), self.clock()
