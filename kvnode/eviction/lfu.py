"""LFU with dynamic aging (LFU-DA, Arlitt et al. 2000): the page with the lowest priority
goes, where a page's priority is the cache's age plus its uses, and the cache's age is
the priority of the last page evicted. Ties go to the least recently used.

Why the aging: without it, pages used often long ago would hold the cache forever; with it a
new page starts at the age of the last eviction, so old counts lose their weight as the age
rises. Uses are counted without a bound; priorities only grow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from kvnode.eviction.candidates import Candidates, CountingOrder, Page
from kvnode.eviction.policy import EvictionPolicy


# One Candidates heap of the evictable pages, ranked by (priority, last use) packed into one int
# (priority above the tick's TICK_BITS): a pop over 100,000s of entries compares ranks ~20 times,
# and one int compares faster than a nested tuple.
TICK_BITS = 48  # ticks (uses) before a rank's tick would spill into its priority: 2.8e14


def _rank(priority: int, tick: int) -> int:
    return (priority << TICK_BITS) | tick


def _priority(rank: int) -> int:
    return rank >> TICK_BITS


@dataclass(slots=True)
class _Entry:
    uses: int
    rank: int  # _rank(priority, tick of the last use)
    children: int  # the page's child count when the order last saw it


class LfuOrder(CountingOrder):
    def __init__(self, policy: EvictionPolicy, pages: Mapping[bytes, Page]):
        super().__init__(policy, pages)
        self._entries: dict[bytes, _Entry] = {}
        self._candidates = Candidates()
        self.age = 0

    def offer(self, key: bytes, page: Page) -> None:
        entry = self._entries.get(key)
        if entry is None:  # stored: its first use
            entry = self._entries[key] = _Entry(1, _rank(self.age + 1, self._next_tick()), page.children)
        self._queue(key, entry, page)

    def touched(self, key: bytes, page: Page) -> None:
        entry = self._entries[key]
        if page.children <= entry.children:  # a use; a child joining (see CountingOrder) only refreshes its last use
            entry.uses += 1
            entry.rank = _rank(self.age + entry.uses, self._next_tick())
        else:
            entry.rank = _rank(_priority(entry.rank), self._next_tick())
        entry.children = page.children
        self._queue(key, entry, page)

    def pop(self, now: float, protect: bytes) -> bytes | None:
        found = self._candidates.pop(self._current, now, protect)
        if found is None:
            return None
        rank, key = found
        self.age = max(self.age, _priority(rank))  # a non-leaf that became a leaf may rank below the age
        del self._entries[key]
        return key

    def _queue(self, key: bytes, entry: _Entry, page: Page) -> None:
        if self.may_evict(page):
            self._candidates.push(entry.rank, key, len(self._pages), self._live)

    def _current(self, rank: int, key: bytes) -> Page | None:
        entry = self._entries.get(key)
        if entry is None or entry.rank != rank:
            return None
        page = self._pages[key]
        return page if self.may_evict(page) else None

    def _live(self) -> list[tuple[int, bytes]]:
        return [(e.rank, k) for k, e in self._entries.items() if self.may_evict(self._pages[k])]

    def check(self) -> None:
        assert self._entries.keys() == self._pages.keys(), "the order's pages differ from the store's"
        entries = self._candidates.entries()
        for key, entry in self._entries.items():
            assert entry.uses >= 1 and _priority(entry.rank) <= self.age + entry.uses, f"page {key.hex()} priority is off"
            if self.is_free(self._pages[key]):
                assert (entry.rank, key) in entries, f"page {key.hex()} cannot be evicted: no queue entry"
