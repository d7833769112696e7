"""Pins on the page store's pages (kvnode/store.py): the data plane's reads straight from the
pool, and read()'s copies. PageStore mixes PagePins in; its methods work on the store's index,
queues, tiers and counters; callers of its private ones hold the store's lock.

Design notes (numbered 4 among the store's before it moved here)
1. Pins are for the data plane, which sends pages straight from the pool: a pinned page
   is never evicted, so its slot is not overwritten while its bytes are on their way.
   Unlike a lease a pin does not expire: the pinner releases it in a `finally`.
"""

from __future__ import annotations

from typing import Sequence

from kvnode.store_types import PageNotFound


class PagePins:
    """PageStore's pins (design note 1), mixed into it."""

    def read(self, keys: Sequence[bytes], prefix: bytes = b"") -> bytes:
        """`prefix` followed by the pages' bytes, back to back, in one copy; touches the pages.

        The prefix lets a caller frame the pages for the wire without copying them twice.
        """
        with self._lock:
            views = self._pin(keys)
            try:
                return b"".join([prefix, *views])
            finally:
                del views
                self._unpin(keys)

    def pin_pages(self, keys: Sequence[bytes]) -> list[memoryview]:
        """Read-only views of the pages' bytes in the pool, pinned until unpin_pages(keys);
        touches them and counts them as sent. Nothing is pinned when a key is not cached
        (or its bytes on disk turn out corrupted: store_drops.py note 1)."""
        with self._lock:
            return self._pin(keys)

    def pin_slots(self, keys: Sequence[bytes]) -> tuple[list[int | None], list[memoryview]]:
        """pin_pages for a reader of the shared pool (kvnode/shared_pool.py): each page's RAM slot,
        or None for one served from a buffer of its own (on disk only, no RAM slot to be had),
        whose bytes the reader must be sent, and pin_pages' views. Pinned until unpin_pages(keys)."""
        with self._lock:
            views = self._pin(keys)
            return [self._index[key].slot for key in keys], views

    def unpin_pages(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._unpin(keys)

    def num_pinned(self) -> int:
        with self._lock:
            return sum(1 for page in self._index.values() if page.pins)

    def _pin(self, keys: Sequence[bytes]) -> list[memoryview]:
        """Read-only views of the pages' bytes, each pinned (read from disk first when it is there
        only); all or nothing: PageNotFound unpins what it pinned. A page is pinned before it is
        touched, so the touch queues nothing: its last unpin queues it (eviction's note 2)."""
        pages = []
        for key in keys:
            page = self._index.get(key)
            if page is None:
                raise PageNotFound(key)
            pages.append(page)
        views: list[memoryview] = []
        tiers, index, touched = self._tiers, self._index, self._queue.touched
        for key, page in zip(keys, pages):
            view = self._view(page.slot) if tiers is None else tiers.bytes_of(key, page)
            if view is None or index.get(key) is not page:  # lost on disk, or dropped with a lost page
                self._unpin(keys[: len(views)])
                raise PageNotFound(key)
            views.append(view)
            page.pins += 1
            self._tick += 1  # _touch, but for the RAM queue: the last unpin queues the page
            page.tick = self._tick
            touched(key, page)
        self.stats.get_pages += len(keys)
        self.stats.bytes_out += self.page_bytes * len(keys)
        return views

    def _unpin(self, keys: Sequence[bytes]) -> None:
        index, condemned, offer = self._index, self._condemned, self._queue.offer
        ram_offer = self._tiers.ram_queue.offer if self._tiers is not None else None
        for key in keys:
            page = index.get(key) or condemned[key]  # a pinned page is never evicted (store_drops note 2)
            assert page.pins > 0, f"page {key.hex()} unpinned more often than pinned"
            page.pins -= 1
            if page.pins:
                continue
            if condemned and condemned.get(key) is page:
                del condemned[key]
                self._release_slots(key, page)
                continue
            if page.lease_until == 0.0:
                offer(key, page)
            if ram_offer is not None:
                ram_offer(key, page)
