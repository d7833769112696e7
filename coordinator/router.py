"""Which worker serves a request: the live worker with the fewest outstanding requests,
preferring the one that last served the same placement key when loads are close
(its local prefix cache is warm). A request that bypasses the cache (`no_cache`) leaves nothing
warm behind, so it neither follows nor sets that preference: remembered, a burst of uncached
requests sent the first cached requests of their families to one worker, cold (`kvcache bench
load` put three of its four first cache-pass requests on one of two workers)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable

CLOSE_LOAD = 2  # outstanding requests a warm worker may carry beyond the least loaded one
MAX_REMEMBERED_KEYS = 100_000


class Router:
    def __init__(self, close_load: int = CLOSE_LOAD):
        self.close_load = close_load
        self._outstanding: dict[str, int] = {}
        self._last_worker: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self.affinity = {True: 0, False: 0}  # choices that went (or not) to the key's warm worker, for metrics

    def choose(self, key: str, workers: Iterable[str], exclude: Iterable[str] = (), cached: bool = True) -> str | None:
        """Pick a worker for `key` among `workers` (minus `exclude`) and count it as outstanding;
        `cached=False` (a request that bypasses the cache): the least loaded, nothing remembered."""
        excluded = set(exclude)
        with self._lock:
            candidates = sorted(w for w in workers if w not in excluded)
            if not candidates:
                return None
            least = min(candidates, key=lambda w: self._outstanding.get(w, 0))
            if not cached:
                self._outstanding[least] = self._outstanding.get(least, 0) + 1
                return least
            chosen = least
            warm = self._last_worker.get(key)
            if warm in candidates and self._outstanding.get(warm, 0) <= self._outstanding.get(least, 0) + self.close_load:
                chosen = warm
            self.affinity[chosen == warm] += 1
            self._outstanding[chosen] = self._outstanding.get(chosen, 0) + 1
            self._last_worker[key] = chosen
            self._last_worker.move_to_end(key)
            if len(self._last_worker) > MAX_REMEMBERED_KEYS:
                self._last_worker.popitem(last=False)
            return chosen

    def done(self, worker: str) -> None:
        with self._lock:
            self._outstanding[worker] = max(0, self._outstanding.get(worker, 0) - 1)

    def outstanding(self, worker: str) -> int:
        return self._outstanding.get(worker, 0)
