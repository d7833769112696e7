"""ARC (Megiddo and Modha, FAST'03): a recency list T1 (pages used once since stored) and a
frequency list T2 (used again), each in LRU order, with ghost lists B1 and B2 of the keys
they evicted lately; a target size p for T1 moves towards whichever ghost list gets hits.

Each list is a Candidates heap of its evictable pages (under the leaf rule, leaves) ranked by
the tick the page entered it or was last used in it, so "the LRU page of T1" is T1's least
recently used evictable page. The sizes |T1| and |T2| count every page in the list, evictable
or not, as ARC's adaptation needs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping

from kvnode.eviction.candidates import Page, SegmentedOrder
from kvnode.eviction.policy import EvictionPolicy

T1, T2 = 1, 2


@dataclass(slots=True)
class _Entry:
    where: int  # T1 or T2
    rank: int
    children: int  # the page's child count when the order last saw it


class ArcOrder(SegmentedOrder):
    def __init__(self, policy: EvictionPolicy, pages: Mapping[bytes, Page]):
        super().__init__(policy, pages, (T1, T2))
        self._entries: dict[bytes, _Entry] = {}
        self._ghosts: dict[int, OrderedDict[bytes, None]] = {T1: OrderedDict(), T2: OrderedDict()}  # B1, B2
        self.target_t1 = 0.0  # ARC's p
        self.capacity = 0  # ARC's c: the pages cached when the store first asks for a victim (the pool is full)

    def offer(self, key: bytes, page: Page) -> None:
        entry = self._entries.get(key)
        if entry is None:  # stored: a miss
            entry = self._entries[key] = _Entry(self._admit(key), self._next_tick(), page.children)
            self._sizes[entry.where] += 1
            self._trim_ghosts()
        self._queue(key, entry, page)

    def _admit(self, key: bytes) -> int:
        """The list a stored page enters, adapting p on a ghost hit. The store asks for a victim before
        it says which key it stores, so p adapts one eviction later than in classic ARC, and
        REPLACE's tie rule for a B2 hit (evict from T1 when |T1| = p) is not applied."""
        b1, b2 = self._ghosts[T1], self._ghosts[T2]
        if key in b1:
            self.target_t1 = min(float(self.capacity), self.target_t1 + max(len(b2) / len(b1), 1.0))
            del b1[key]
            return T2
        if key in b2:
            self.target_t1 = max(0.0, self.target_t1 - max(len(b1) / len(b2), 1.0))
            del b2[key]
            return T2
        return T1

    def touched(self, key: bytes, page: Page) -> None:
        entry = self._entries[key]
        # A use moves the page to T2's most recent end; a child joining (see CountingOrder) only
        # refreshes it in its list.
        used = page.children <= entry.children
        entry.children = page.children
        if used and entry.where == T1:
            self._sizes[T1] -= 1
            self._sizes[T2] += 1
            entry.where = T2
        entry.rank = self._next_tick()
        self._queue(key, entry, page)

    def pop(self, now: float, protect: bytes) -> bytes | None:
        self.capacity = max(self.capacity, len(self._pages))
        t1 = self._sizes[T1]
        first = T1 if t1 and t1 > self.target_t1 else T2
        for where in (first, T2 if first == T1 else T1):  # the other list when the first has no evictable page
            found = self._segments[where].pop(self._current_in(where), now, protect)
            if found is not None:
                key = found[1]
                del self._entries[key]
                self._sizes[where] -= 1
                self._ghosts[where][key] = None
                self._trim_ghosts()
                return key
        return None

    def _trim_ghosts(self) -> None:
        # Bounded as in ARC, the oldest ghost first: |T1| + |B1| <= c, |T1| + |T2| + |B1| + |B2| <= 2c.
        b1, b2 = self._ghosts[T1], self._ghosts[T2]
        c = self.capacity
        while b1 and self._sizes[T1] + len(b1) > c:
            b1.popitem(last=False)
        while (b1 or b2) and self._sizes[T1] + self._sizes[T2] + len(b1) + len(b2) > 2 * c:
            (b2 if b2 else b1).popitem(last=False)

    def check(self) -> None:
        self._check_segments(self._sizes)
        b1, b2 = self._ghosts[T1], self._ghosts[T2]
        assert not (b1.keys() & self._pages.keys()) and not (b2.keys() & self._pages.keys()), "a ghost is cached"
        assert not (b1.keys() & b2.keys()), "a key is in both ghost lists"
        assert self._sizes[T1] + len(b1) <= max(self.capacity, self._sizes[T1]), "B1 is over its bound"
        assert 0.0 <= self.target_t1 <= max(self.capacity, 0), f"p = {self.target_t1} is out of [0, c]"
