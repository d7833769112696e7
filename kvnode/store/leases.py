"""Leases on a store's pages (kvnode/store/page_store.py): who holds one until when,
how many are held, and their expiry, lazily. The store decides what to lease; this module keeps
the count and the heap. Callers hold the store's lock."""

from __future__ import annotations

import heapq
from typing import Callable, Mapping

from kvnode.eviction.candidates import Page


class Leases:
    """Leases on the pages of `index`, at most `max_leased` at once; a page's `lease_until` is 0.0
    when it holds none. Expired entries are retired lazily; a renewal leaves a stale entry, and
    stale entries are compacted away when they outnumber the live ones (2x + 64)."""

    def __init__(self, index: Mapping[bytes, Page], max_leased: int):
        self.max_leased = max_leased
        self.num_leased = 0
        self._index = index
        self._heap: list[tuple[float, bytes]] = []  # (expiry, key), stale entries included

    def heap_size(self) -> int:
        return len(self._heap)

    def can_lease(self, page: Page) -> bool:
        """A lease held may always be renewed; a new one only below the bound."""
        return page.lease_until != 0.0 or self.num_leased < self.max_leased

    def lease(self, key: bytes, page: Page, until: float) -> None:
        if until <= page.lease_until:
            return
        if page.lease_until == 0.0:
            self.num_leased += 1
        page.lease_until = until
        heapq.heappush(self._heap, (until, key))
        if len(self._heap) > 2 * self.num_leased + 64:
            self._compact()

    def retire(self, now: float, ended: Callable[[bytes, Page], None]) -> None:
        """End the leases that ran out by `now`, calling `ended` for each of their pages."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            until, key = heapq.heappop(heap)
            page = self._index.get(key)
            if page is None or page.lease_until != until:
                continue  # renewed since, or gone
            page.lease_until = 0.0
            self.num_leased -= 1
            ended(key, page)

    def dropped(self, page: Page) -> None:
        """`page` left the index (its heap entry goes stale): its lease, if any, no longer counts."""
        if page.lease_until != 0.0:
            page.lease_until = 0.0
            self.num_leased -= 1

    def _compact(self) -> None:
        """Drop the heap's stale entries: O(heap), after as many renewals."""
        index = self._index
        live = [(until, key) for until, key in self._heap
                if (page := index.get(key)) is not None and page.lease_until == until]
        heapq.heapify(live)
        self._heap = live

    def check(self) -> None:
        leased = {(p.lease_until, k) for k, p in self._index.items() if p.lease_until > 0.0}
        assert len(leased) == self.num_leased, f"leased count {self.num_leased} != {len(leased)}"
        assert len(leased) <= self.max_leased, f"{len(leased)} pages leased, over the bound {self.max_leased}"
        assert leased <= set(self._heap), "a leased page has no lease heap entry"
