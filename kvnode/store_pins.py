"""Pins on the page store's pages (kvnode/store.py): the data plane's reads straight from the
pool, and read()'s copies. PageStore mixes PagePins in; its methods work on the store's index,
queues, tiers and counters; callers of its private ones hold the store's lock.

Design notes (numbered 4 among the store's before it moved here)
1. Pins are for the data plane, which sends pages straight from the pool: a pinned page
   is never evicted, so its slot is not overwritten while its bytes are on their way.
   Unlike a lease a pin does not expire: the pinner releases it in a `finally`.
2. Pinning and unpinning cannot leave a pin behind, whatever fails partway: a pin of several
   pages pins all of them or none (whatever raised, what it pinned is unpinned), and an unpin
   releases every key it is given before it raises the first error it met. A pin left behind
   would hold its page, and under a disk tier its RAM copy, for good.
"""

from __future__ import annotations

import logging
from typing import Sequence

from kvnode.store_types import PageNotFound

log = logging.getLogger("kvnode")


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
        only); all or nothing (note 2): PageNotFound, or any other error, unpins what it pinned.
        A page is pinned before it is touched, so the touch queues nothing: its last unpin
        queues it (eviction's note 2)."""
        pages = []
        for key in keys:
            page = self._index.get(key)
            if page is None:
                raise PageNotFound(key)
            pages.append(page)
        views: list[memoryview] = []
        tiers, index, touched = self._tiers, self._index, self._queue.touched
        pinned = 0
        try:
            for key, page in zip(keys, pages):
                view = self._view(page.slot) if tiers is None else tiers.bytes_of(key, page)
                if view is None or index.get(key) is not page:  # lost on disk, or dropped with a lost page
                    raise PageNotFound(key)
                views.append(view)
                page.pins += 1
                pinned += 1
                self._tick += 1  # _touch, but for the RAM queue: the last unpin queues the page
                page.tick = self._tick
                touched(key, page)
        except BaseException:
            try:
                self._unpin(keys[:pinned])
            except Exception:  # every pin is off all the same (note 2); the first error is the caller's
                log.exception("releasing the pins of a pin that failed failed too")
            raise
        self.stats.get_pages += len(keys)
        self.stats.bytes_out += self.page_bytes * len(keys)
        return views

    def _unpin(self, keys: Sequence[bytes]) -> None:
        """One pin off each of `keys`, each unpinned even when another fails (note 2); then the
        first error, if any."""
        index, condemned, offer = self._index, self._condemned, self._queue.offer
        ram_offer = self._tiers.ram_queue.offer if self._tiers is not None else None
        error = None
        for key in keys:
            try:
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
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
