"""What every eviction order shares: the page as an order reads it, the bases of the orders, and
Candidates, a heap of eviction candidates that is never edited in the middle, which keeps every
order's operations O(log n) amortized.
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterable, Mapping, Protocol

from kvnode.eviction.policy import EvictionPolicy


class Page(Protocol):
    """What the orders read of a store's page."""

    tick: int  # last touch
    stored_tick: int  # when it was stored
    children: int  # cached pages that name it as parent
    lease_until: float  # 0.0 when not leased
    pins: int  # readers sending the page's bytes straight from the pool right now
    slot: int | None  # its RAM slot; None when it is on disk only (ram_queue.py)


class Candidates:
    """A min-heap of (rank, key) of pages that may be evicted, smallest rank first, lazily invalidated.

    Entries are never removed from the middle: when a page's rank changes, the order pushes a new
    entry and the old one goes stale. An entry is valid only while the order says it is current
    (the page exists, still has that rank in that queue, may be evicted); stale entries are
    skipped when popped and dropped when the heap is rebuilt, once it holds more than twice the
    pages cached (+64). So every operation is O(log n) amortized."""

    def __init__(self) -> None:
        self.heap: list[tuple] = []

    def push(self, rank, key: bytes, num_pages: int, live: Callable[[], Iterable[tuple]]) -> None:
        heapq.heappush(self.heap, (rank, key))
        if len(self.heap) > 2 * num_pages + 64:
            self.heap = list(live())
            heapq.heapify(self.heap)

    def pop(self, current: Callable[[object, bytes], Page | None], now: float, protect: bytes) -> tuple | None:
        """The first (rank, key) whose page `current` returns, not leased or pinned, not `protect`; taken off.
        A leased or pinned one is dropped: the store offers it again when its lease ends or its last
        pin is released, and the order pushes it back at its unchanged rank."""
        heap = self.heap
        held = []
        found = None
        while heap:
            rank, key = heapq.heappop(heap)
            page = current(rank, key)
            if page is None or page.lease_until > now or page.pins:
                continue  # stale; a leased or pinned page is offered again when that ends
            if key == protect:
                held.append((rank, key))
                continue
            found = (rank, key)
            break
        for entry in held:
            heapq.heappush(heap, entry)
        return found

    def entries(self) -> set[tuple]:
        return set(self.heap)


class Order:
    """The base of every order: what the store calls, and the leaf rule."""

    def __init__(self, policy: EvictionPolicy, pages: Mapping[bytes, Page]):
        self.policy = policy
        self._pages = pages  # the store's index, read only

    def may_evict(self, page: Page) -> bool:
        """Whether the policy allows evicting `page` once it is unleased and unpinned."""
        return not (self.policy.leaves_only and page.children)

    def is_free(self, page: Page) -> bool:
        """Evictable now, as far as the store's leases and pins go (tests' checks, not leases' expiry)."""
        return self.may_evict(page) and page.lease_until == 0.0 and not page.pins

    def offer(self, key: bytes, page: Page) -> None:
        """`key` was stored, or its lease ended, or its last pin was released."""
        raise NotImplementedError

    def touched(self, key: bytes, page: Page) -> None:
        raise NotImplementedError

    def lost_last_child(self, key: bytes, page: Page) -> None:
        raise NotImplementedError

    def removed(self, key: bytes) -> None:
        """`key` left the store's index, not through pop(): dropped (kvnode/store/drops.py: lost on
        disk, or reported altered, with its descendants). An order that keeps an entry per page
        forgets it here, or it would later read a page the index no longer has. A dropped page was
        not the order's choice and says nothing of its use: it leaves no ghost (ARC, S3-FIFO) and
        does not age LFU."""
        raise NotImplementedError

    def pop(self, now: float, protect: bytes) -> bytes | None:
        """The key to evict next (never `protect`); the store evicts it. None when nothing may go."""
        raise NotImplementedError

    def check(self) -> None:
        """Assert the order's own bookkeeping (tests call it after every step)."""
        raise NotImplementedError


class CountingOrder(Order):
    """An order that counts uses (ARC, S3-FIFO, LFU): an entry per page, with at least its `rank`
    and the child count it saw last, and its own tick for ranks.

    A touch is a use, except the one a parent gets as a child joins it (the store touches the
    parent as it stores the child): the child count grows by one with that touch, so the order
    tells the two apart by the count it saw last. Otherwise a chain stored once would count every
    page but the last as used twice."""

    def __init__(self, policy: EvictionPolicy, pages: Mapping[bytes, Page]):
        super().__init__(policy, pages)
        self._entries: dict = {}  # key -> the order's entry
        self._tick = 0

    def lost_last_child(self, key: bytes, page: Page) -> None:
        entry = self._entries[key]
        entry.children = 0
        if self.policy.leaves_only:
            self._queue(key, entry, page)

    def removed(self, key: bytes) -> None:
        """Forget `key`'s entry (see Order.removed); its heap entries go stale."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._forget(entry)

    def _forget(self, entry) -> None:
        """What an order counts beside its entries, less a removed page's `entry`."""

    def _queue(self, key: bytes, entry, page: Page) -> None:
        raise NotImplementedError

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick


class SegmentedOrder(CountingOrder):
    """An order whose pages sit in one of a few Candidates heaps (`entry.where`) ranked by
    `entry.rank`: ARC's T1 and T2, S3-FIFO's small and main queues."""

    def __init__(self, policy: EvictionPolicy, pages: Mapping[bytes, Page], segments: Iterable[int]):
        super().__init__(policy, pages)
        self._segments = {where: Candidates() for where in segments}
        self._sizes = {where: 0 for where in self._segments}  # pages in each segment, evictable or not

    def _forget(self, entry) -> None:
        self._sizes[entry.where] -= 1

    def _queue(self, key: bytes, entry, page: Page) -> None:
        if self.may_evict(page):
            where = entry.where
            self._segments[where].push(entry.rank, key, len(self._pages), lambda: self._live(where))

    def _current_in(self, where: int):
        def current(rank: int, key: bytes) -> Page | None:
            entry = self._entries.get(key)
            if entry is None or entry.where != where or entry.rank != rank:
                return None
            page = self._pages[key]
            return page if self.may_evict(page) else None

        return current

    def _live(self, where: int) -> list[tuple[int, bytes]]:
        return [(e.rank, k) for k, e in self._entries.items() if e.where == where and self.may_evict(self._pages[k])]

    def _check_segments(self, sizes: dict[int, int]) -> None:
        """The order's entries are the store's pages, each segment counts what it holds, and every
        page that may go now has a live entry in its segment's heap (`check`'s common part)."""
        assert self._entries.keys() == self._pages.keys(), "the order's pages differ from the store's"
        for where, heap in self._segments.items():
            size = sum(1 for e in self._entries.values() if e.where == where)
            assert size == sizes[where], f"segment {where} counts {sizes[where]} pages, holds {size}"
            entries = heap.entries()
            for key, entry in self._entries.items():
                if entry.where == where and self.is_free(self._pages[key]):
                    assert (entry.rank, key) in entries, f"page {key.hex()} cannot be evicted: no queue entry"
