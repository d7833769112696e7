"""Dropping pages from the page store (kvnode/store/page_store.py): an evicted page, and a page
lost on disk or reported altered, with its descendants; the slots of one dropped while pinned
wait for its last unpin. A page leaves the index here only. Callers hold the store's lock.
"""

from __future__ import annotations

import logging
from typing import Callable

from kvnode.wire.checksum import page_checksum
from kvnode.eviction import EvictionQueue
from kvnode.store.leases import Leases
from kvnode.store.orphans import Orphans
from kvnode.store.types import StoreStats, _Page
from kvnode.store.tiers import Tiers

log = logging.getLogger("kvnode")


class PageDrops:
    """Takes pages out of `index`, telling the eviction `queue`, the `leases`, the `orphans` and
    the `tiers` (None without a disk tier), and returns their slots: RAM ones to `free_slots`.
    `bytes_of(key, page)` reads a page's bytes (None when the disk lost it)."""

    def __init__(self, index: dict[bytes, _Page], queue: EvictionQueue, leases: Leases, orphans: Orphans,
                 free_slots: list[int], tiers: Tiers | None,
                 bytes_of: Callable[[bytes, _Page], memoryview | None], stats: StoreStats):
        # Dropped while pinned (a descendant being sent, or flushed): out of the index at once, so no
        # lookup counts it and no fetch pins it again; only its slots wait here, for its last unpin
        # (a sender still reads them). Until then its key cannot be stored again (REFUSED_NO_ROOM),
        # so an unpin by key always finds the right page.
        self.condemned: dict[bytes, _Page] = {}
        self._index = index
        self._queue = queue
        self._leases = leases
        self._orphans = orphans
        self._free_slots = free_slots
        self._tiers = tiers
        self._bytes_of = bytes_of
        self._stats = stats

    def drop_reported(self, key: bytes) -> int:
        """A reader found page `key`'s bytes do not match its checksum: drop it and its descendants
        when the node's own bytes fail it too; how many went, 0 when it is not cached or is intact
        here (so a reader cannot drop good pages, only report bad ones)."""
        page = self._index.get(key)
        if page is None:
            return 0
        view = self._bytes_of(key, page)
        if view is not None and self._index.get(key) is page and page_checksum(key, view) == page.checksum:
            self._stats.reported_kept += 1  # the node's copy is intact: the reader's was altered on the way
            if self._tiers is not None:
                self._tiers.ram_queue.offer(key, page)  # promoted just now: its RAM copy may make room
            return 0
        if self._index.get(key) is not page:  # lost on disk meanwhile, with its descendants
            return 0
        dropped = self.drop_subtree(key)
        self._stats.reported_dropped += dropped
        return dropped

    def drop_lost(self, key: bytes, why: str, corrupted: bool) -> None:
        """The disk lost `key` (its slot failed its check, or cannot be read): it is never served, so
        drop it and its descendants (unreachable without it), with one log line."""
        dropped = self.drop_subtree(key)
        self._stats.corrupted_dropped += corrupted
        self._stats.orphans_dropped += dropped - 1
        log.warning("page %s %s: dropped it and %d descendants", key.hex(), why, dropped - 1)

    def drop_subtree(self, key: bytes) -> int:
        """Drop `key` and its descendants from the node at once (a pinned one's slots wait for its
        last unpin: see `condemned`); how many."""
        children: dict[bytes, list[bytes]] = {}
        for k, p in self._index.items():
            if p.parent:
                children.setdefault(p.parent, []).append(k)
        order = [key]
        for k in order:
            order.extend(children.get(k, ()))
        for k in reversed(order):  # leaves first
            self.evict(k, popped=False)
        return len(order)

    def evict(self, key: bytes, popped: bool = True) -> None:
        """Drop `key` from the node, its slots back to the free lists (once unpinned: see `condemned`).
        `popped`: the eviction order chose it (an eviction; its pop forgot the page); otherwise it
        is dropped, and the order is told: one that keeps an entry per page (ARC, S3-FIFO, LFU)
        would otherwise keep the page's entry and fail on its next read of it."""
        page = self._index.pop(key)
        if not popped:
            self._queue.removed(key)
        self._leases.dropped(page)  # only a page dropped with a lost ancestor can be leased
        self._stats.evictions += popped
        parent = self._index.get(page.parent) if page.parent else None
        if parent is not None:
            parent.children -= 1
            if parent.children == 0:
                self._queue.lost_last_child(page.parent, parent)
        elif page.parent:  # an orphan goes
            self._orphans.remove(page.parent)
        if page.children:  # only lru and fifo evict a page with cached children: they become orphans
            self._orphans.add(key, page.children)
        if self._tiers is not None:
            self._tiers.dropped(key)
        if page.pins:
            self.condemned[key] = page
        else:
            self._release_slots(key, page)

    def release_condemned(self, key: bytes, page: _Page) -> bool:
        """`page`, unpinned for the last time, was dropped while pinned: its slots go free now."""
        if self.condemned.get(key) is not page:
            return False
        del self.condemned[key]
        self._release_slots(key, page)
        return True

    def _release_slots(self, key: bytes, page: _Page) -> None:
        if page.slot is not None:
            self._free_slots.append(page.slot)
        if self._tiers is not None:
            self._tiers.forget(key, page)
