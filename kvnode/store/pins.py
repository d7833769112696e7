"""Pins on the page store's pages (kvnode/store/page_store.py): the data plane's reads straight from
the pool, and read()'s copies. A pinned page is never evicted, so its slot is not overwritten while
its bytes are on their way. Unlike a lease a pin does not expire: the pinner releases it in a
`finally`. A pin is a count on the page record; callers hold the store's lock.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from kvnode.eviction import EvictionQueue, RamQueue
from kvnode.store.drops import PageDrops
from kvnode.store.types import PageNotFound, StoreStats, _Page

log = logging.getLogger("kvnode")


class PagePins:
    """Pins on the pages of `index`. `bytes_of(key, page)` reads a page's bytes (None when the
    disk lost it); `touch(key, page)` marks a page used for the eviction `queue`; the last unpin
    queues a page again, there and in the `ram_queue` (None without a disk tier), or, for a page
    dropped while pinned, frees its slots (`drops`). Counts what it pins as sent in `stats`."""

    def __init__(self, index: dict[bytes, _Page], queue: EvictionQueue, ram_queue: RamQueue | None,
                 drops: PageDrops, bytes_of: Callable[[bytes, _Page], memoryview | None],
                 touch: Callable[[bytes, _Page], None], stats: StoreStats, page_bytes: int):
        self._index = index
        self._queue = queue
        self._ram_queue = ram_queue
        self._drops = drops
        self._bytes_of = bytes_of
        self._touch = touch
        self._stats = stats
        self._page_bytes = page_bytes

    def read(self, keys: Sequence[bytes], prefix: bytes = b"") -> bytes:
        """`prefix` followed by the pages' bytes, back to back, in one copy; touches the pages."""
        views = self.pin(keys)
        try:
            return b"".join([prefix, *views])
        finally:
            del views
            self.unpin(keys)

    def num_pinned(self) -> int:
        return sum(1 for page in self._index.values() if page.pins)

    def pin(self, keys: Sequence[bytes]) -> list[memoryview]:
        """Read-only views of the pages' bytes, each pinned (read from disk first when it is there
        only) and counted as sent; all or nothing: PageNotFound, or any other error, unpins what
        it pinned (a pin left behind would hold its page, and under a disk tier its RAM copy, for
        good). A page is pinned before it is touched, so the touch queues nothing: its last unpin
        queues it."""
        pages = []
        for key in keys:
            page = self._index.get(key)
            if page is None:
                raise PageNotFound(key)
            pages.append(page)
        views: list[memoryview] = []
        index, bytes_of, touch = self._index, self._bytes_of, self._touch
        pinned = 0
        try:
            for key, page in zip(keys, pages):
                view = bytes_of(key, page)
                if view is None or index.get(key) is not page:  # lost on disk, or dropped with a lost page
                    raise PageNotFound(key)
                views.append(view)
                page.pins += 1
                pinned += 1
                touch(key, page)
        except BaseException:
            try:
                self.unpin(keys[:pinned])
            except Exception:  # every pin is off all the same (see unpin); the first error is the caller's
                log.exception("releasing the pins of a pin that failed failed too")
            raise
        self._stats.get_pages += len(keys)
        self._stats.bytes_out += self._page_bytes * len(keys)
        return views

    def unpin(self, keys: Sequence[bytes]) -> None:
        """One pin off each of `keys`, each unpinned even when another fails, so no pin is left
        behind; then the first error, if any."""
        index, drops, offer, ram_queue = self._index, self._drops, self._queue.offer, self._ram_queue
        condemned = drops.condemned
        error = None
        for key in keys:
            try:
                page = index.get(key) or condemned[key]  # a pinned page is never evicted, only dropped
                assert page.pins > 0, f"page {key.hex()} unpinned more often than pinned"
                page.pins -= 1
                if page.pins:
                    continue
                if condemned and drops.release_condemned(key, page):
                    continue
                if page.lease_until == 0.0:
                    offer(key, page)
                if ram_queue is not None:
                    ram_queue.offer(key, page)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
