"""With a disk tier, which RAM copy makes room next (the store's second queue).

Apart from the eviction order: a page whose RAM copy goes stays on the node, on disk.
"""

from __future__ import annotations

import heapq
from typing import Mapping

from kvnode.eviction.candidates import Page


class RamQueue:
    """With a disk tier: the pages with a copy in RAM, least recently touched first; which RAM copy
    makes room next. Its page stays on the node, on disk (the store writes it there first if it
    was not yet), so leases do not hold a copy in RAM and any page may go, leaf or not. A pinned
    copy is dropped when popped; the store offers it again when its last pin is released.
    Entries are invalidated lazily, as the orders' candidates are (candidates.py)."""

    def __init__(self, pages: Mapping[bytes, Page]):
        self._pages = pages  # the store's index, read only
        self._heap: list[tuple[int, bytes]] = []

    def offer(self, key: bytes, page: Page) -> None:
        """Queue `key` at its last touch, if it has a copy in RAM and is not pinned (the store
        offers it again when its last pin is released: pop would drop the entry anyway)."""
        if page.slot is None or page.pins:
            return
        heapq.heappush(self._heap, (page.tick, key))
        if len(self._heap) > 2 * len(self._pages) + 64:
            self._heap = [(p.tick, k) for k, p in self._pages.items() if p.slot is not None]
            heapq.heapify(self._heap)

    def pop(self) -> bytes | None:
        """The key whose RAM copy goes next, taken off the queue; None when every copy is pinned."""
        heap = self._heap
        while heap:
            tick, key = heapq.heappop(heap)
            page = self._pages.get(key)
            if page is None or page.slot is None or page.tick != tick or page.pins:
                continue  # stale entry; a pinned copy is offered again when unpinned
            return key
        return None

    def check(self) -> None:
        entries = set(self._heap)
        for key, page in self._pages.items():
            if page.slot is not None and not page.pins:
                assert (page.tick, key) in entries, f"page {key.hex()}'s RAM copy has no queue entry"
