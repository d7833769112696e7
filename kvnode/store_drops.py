"""Dropping pages from the page store (kvnode/store.py): an evicted page, and a page lost on disk
or reported altered with its descendants; the slots of one dropped while pinned wait for its last
unpin. PageStore mixes PageDrops in; its methods work on the store's index, queues, leases, tiers
and counters, and callers hold the store's lock (drop_reported takes it).

Design notes (numbered 7 and 8 among the store's before they moved here)
1. A page whose slot fails its check, or cannot be read, is never served: it is dropped with
   its descendants (unreachable without it). At start the index is rebuilt from the slots, each
   checked whole (kvnode/recovery.py); afterwards a read checks the slot's header only, unless
   the disk check is `always`, and a page altered on disk since is caught by its reader
   (kvnode/store.py note 9).
2. A page dropped while pinned (note 1: a descendant being sent, or flushed) leaves the index at
   once, so no lookup counts it and no fetch pins it again; only its slots wait, in
   `_condemned`, for its last unpin (a sender is still reading them). Until then its key
   cannot be stored again (REFUSED_NO_ROOM), so an unpin by key always finds the right page.
3. A page leaves the index here only: evicted (the eviction order popped it) or dropped (notes
   1 and 2). A dropped page is one the order did not choose, so `_evict` tells it (removed):
   an order that keeps an entry per page (ARC, S3-FIFO, LFU) would otherwise keep the page's
   entry and fail on its next read of it (kvnode/eviction/candidates.py note 4).
"""

from __future__ import annotations

import logging

from kvnode.checksum import page_checksum
from kvnode.store_types import _Page, check_key

log = logging.getLogger("kvnode")


class PageDrops:
    """PageStore's dropping of pages (design notes 1 and 2), mixed into it."""

    def drop_reported(self, key: bytes) -> int:
        """A reader found page `key`'s bytes do not match its checksum: drop it and its descendants
        (kvnode/store.py design note 9) when the node's own bytes fail it too; how many went, 0 when it is not
        cached or is intact here (so a reader cannot drop good pages, only report bad ones)."""
        check_key(key)
        with self._lock:
            page = self._index.get(key)
            if page is None:
                return 0
            view = self._view(page.slot) if self._tiers is None else self._tiers.bytes_of(key, page)
            if view is not None and self._index.get(key) is page and page_checksum(key, view) == page.checksum:
                self.stats.reported_kept += 1  # the node's copy is intact: the reader's was altered on the way
                if self._tiers is not None:
                    self._tiers.ram_queue.offer(key, page)  # promoted just now: its RAM copy may make room
                return 0
            if self._index.get(key) is not page:  # lost on disk meanwhile, with its descendants
                return 0
            dropped = self._drop_subtree(key)
            self.stats.reported_dropped += dropped
            return dropped

    def _drop_lost(self, key: bytes, why: str, corrupted: bool) -> None:
        """The disk lost `key` (design note 1): drop it and its descendants, with one log line."""
        dropped = self._drop_subtree(key)
        self.stats.corrupted_dropped += corrupted
        self.stats.orphans_dropped += dropped - 1
        log.warning("page %s %s: dropped it and %d descendants", key.hex(), why, dropped - 1)

    def _drop_subtree(self, key: bytes) -> int:
        """Drop `key` and its descendants from the node at once (a pinned one's slots wait for its
        last unpin: design note 2); how many."""
        children: dict[bytes, list[bytes]] = {}
        for k, p in self._index.items():
            if p.parent:
                children.setdefault(p.parent, []).append(k)
        order = [key]
        for k in order:
            order.extend(children.get(k, ()))
        for k in reversed(order):  # leaves first
            self._evict(k, popped=False)
        return len(order)

    def _evict(self, key: bytes, popped: bool = True) -> None:
        """Drop `key` from the node, its slots back to the free lists (once unpinned: note 2).
        `popped`: the eviction order chose it (an eviction; its pop forgot the page); otherwise
        it is dropped, and the order is told (note 3)."""
        page = self._index.pop(key)
        if not popped:
            self._queue.removed(key)
        self._leases.dropped(page)  # only a page dropped with a lost ancestor can be leased (note 1)
        self.stats.evictions += popped
        parent = self._index.get(page.parent) if page.parent else None
        if parent is not None:
            parent.children -= 1
            if parent.children == 0:
                self._queue.lost_last_child(page.parent, parent)
        elif page.parent:  # an orphan goes
            left = self._orphans_by_parent.pop(page.parent) - 1
            if left:
                self._orphans_by_parent[page.parent] = left
            self._num_orphans -= 1
        if page.children:  # only lru and fifo evict a page with cached children: they become orphans
            self._orphans_by_parent[key] = page.children
            self._num_orphans += page.children
        if self._tiers is not None:
            self._tiers.dropped(key)
        if page.pins:
            self._condemned[key] = page
        else:
            self._release_slots(key, page)

    def _release_slots(self, key: bytes, page: _Page) -> None:
        if page.slot is not None:
            self._free_slots.append(page.slot)
        if self._tiers is not None:
            self._tiers.forget(key, page)
