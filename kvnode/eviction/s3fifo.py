"""S3-FIFO (Yang et al., SOSP'23): a small FIFO queue S (a tenth of the cache) that new pages
enter, a main FIFO queue M, and a ghost queue G of keys S evicted lately. Each page counts
its uses up to 3; a use never moves it.

Each queue is a Candidates heap of its evictable pages (under the leaf rule, leaves) ranked by
the tick the page entered it or got its second chance, so a queue's "oldest" is its oldest
evictable page; sizes count every page in a queue. Every move is paid for by a use (at most 3
per use) or by entering M once, so a pop is O(log n) amortized.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping

from kvnode.eviction.candidates import Page, SegmentedOrder
from kvnode.eviction.policy import EvictionPolicy

SMALL, MAIN = 1, 2
SMALL_SHARE = 0.1
MAX_USES = 3


@dataclass(slots=True)
class _Entry:
    where: int  # SMALL or MAIN
    rank: int
    uses: int  # since stored or since its last second chance, at most MAX_USES
    children: int  # the page's child count when the order last saw it


class S3FifoOrder(SegmentedOrder):
    def __init__(self, policy: EvictionPolicy, pages: Mapping[bytes, Page]):
        super().__init__(policy, pages, (SMALL, MAIN))
        self._entries: dict[bytes, _Entry] = {}
        self._ghosts: OrderedDict[bytes, None] = OrderedDict()
        self.capacity = 0  # c: the pages cached when the store first asks for a victim; G holds at most c keys

    def offer(self, key: bytes, page: Page) -> None:
        entry = self._entries.get(key)
        if entry is None:  # stored
            where = MAIN if key in self._ghosts else SMALL
            self._ghosts.pop(key, None)
            entry = self._entries[key] = _Entry(where, self._next_tick(), 0, page.children)
            self._sizes[where] += 1
        self._queue(key, entry, page)

    def touched(self, key: bytes, page: Page) -> None:
        entry = self._entries[key]
        if page.children <= entry.children:  # a use, not a child joining (see CountingOrder)
            entry.uses = min(entry.uses + 1, MAX_USES)
        entry.children = page.children

    def pop(self, now: float, protect: bytes) -> bytes | None:
        """While S holds at least its tenth, its oldest evictable page goes, unless used since stored:
        then it moves to M's young end and the next is looked at. Otherwise M's oldest goes, unless
        its count is above 0: then the count drops by one and it goes back to M's young end (a
        second chance per use). When the chosen queue has no evictable page, the other gives one.
        A page S evicts leaves its key in G; a page stored while its key is in G enters M."""
        self.capacity = max(self.capacity, len(self._pages))
        small_full = self._sizes[SMALL] >= max(1, SMALL_SHARE * self.capacity)
        for where in ((SMALL, MAIN) if small_full else (MAIN, SMALL, MAIN)):
            key = self._evict_small(now, protect) if where == SMALL else self._evict_main(now, protect)
            if key is not None:
                return key
        return None

    def _evict_small(self, now: float, protect: bytes) -> bytes | None:
        queue, current = self._segments[SMALL], self._current_in(SMALL)
        while (found := queue.pop(current, now, protect)) is not None:
            key = found[1]
            entry = self._entries[key]
            if entry.uses:
                self._move(key, entry, MAIN)
                continue
            self._drop(key, entry)
            self._ghosts[key] = None
            while len(self._ghosts) > self.capacity:
                self._ghosts.popitem(last=False)
            return key
        return None

    def _evict_main(self, now: float, protect: bytes) -> bytes | None:
        queue, current = self._segments[MAIN], self._current_in(MAIN)
        while (found := queue.pop(current, now, protect)) is not None:
            key = found[1]
            entry = self._entries[key]
            if entry.uses:
                entry.uses -= 1
                self._move(key, entry, MAIN)
                continue
            self._drop(key, entry)
            return key
        return None

    def _move(self, key: bytes, entry: _Entry, where: int) -> None:
        """To the young end of `where`; uses start again from 0 in M."""
        self._sizes[entry.where] -= 1
        self._sizes[where] += 1
        if entry.where != where:
            entry.uses = 0
        entry.where = where
        entry.rank = self._next_tick()
        self._queue(key, entry, self._pages[key])

    def _drop(self, key: bytes, entry: _Entry) -> None:
        del self._entries[key]
        self._forget(entry)

    def check(self) -> None:
        self._check_segments(self._sizes)
        assert all(0 <= e.uses <= MAX_USES for e in self._entries.values()), "a use count is out of range"
        assert not (self._ghosts.keys() & self._pages.keys()), "a ghost is cached"
        assert len(self._ghosts) <= max(self.capacity, 0), "the ghost queue is over its bound"
