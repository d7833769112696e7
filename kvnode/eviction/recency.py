"""LRU and FIFO: one candidate heap ranked by last touch (lru) or by the tick the page was
stored at (fifo). Under prefix-lru only leaves are queued: a page is offered again when it
loses its last child, at its unchanged rank."""

from __future__ import annotations

from typing import Mapping

from kvnode.eviction.candidates import Candidates, Order, Page
from kvnode.eviction.policy import EvictionPolicy


class RecencyOrder(Order):
    def __init__(self, policy: EvictionPolicy, pages: Mapping[bytes, Page]):
        super().__init__(policy, pages)
        self.by_last_touch = policy.order == "lru"
        self._candidates = Candidates()

    def rank(self, page: Page) -> int:
        return page.tick if self.by_last_touch else page.stored_tick

    def offer(self, key: bytes, page: Page) -> None:
        # A pinned page is offered again when its last pin is released (see Candidates.pop).
        if not page.pins and self.may_evict(page):
            self._candidates.push(self.rank(page), key, len(self._pages), self._live)

    def touched(self, key: bytes, page: Page) -> None:
        if self.by_last_touch and not page.pins:  # a pinned page is offered when unpinned
            self.offer(key, page)

    def lost_last_child(self, key: bytes, page: Page) -> None:
        if self.policy.leaves_only:
            self.offer(key, page)

    def removed(self, key: bytes) -> None:
        """Nothing to forget: its heap entries go stale, `_current` reading the index (see Order.removed)."""

    def pop(self, now: float, protect: bytes) -> bytes | None:
        found = self._candidates.pop(self._current, now, protect)
        return None if found is None else found[1]

    def _current(self, rank: int, key: bytes) -> Page | None:
        page = self._pages.get(key)
        if page is None or self.rank(page) != rank or not self.may_evict(page):
            return None
        return page

    def _live(self):
        return [(self.rank(p), k) for k, p in self._pages.items() if self.may_evict(p)]

    def check(self) -> None:
        entries = self._candidates.entries()
        for key, page in self._pages.items():
            if self.is_free(page):
                assert (self.rank(page), key) in entries, f"page {key.hex()} cannot be evicted: no queue entry"
