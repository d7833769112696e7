"""Eviction policies for the page store, apart from the store that carries them out.

The store keeps slots, pages, leases and child counts; an EvictionQueue tells it which
unleased page to evict next, and the policy says whether a put must find its parent
cached. The caller picks the policy (as vLLM v1's block pool takes its eviction order
from the caller): the node runs prefix-aware; "lru" and "fifo" are what remote stores
that know nothing of prefixes do, kept so `kvcache bench eviction` can compare them on
this very code.

Design notes
1. prefix-aware: only leaves are evicted (pages no cached page names as parent), least
   recently used first, and a put whose parent is not cached is refused, so every
   cached page's whole prefix is cached. lru: any page, least recently touched first.
   fifo: any page, oldest stored first. Both accept a put whose parent is missing, and
   evicting a page whose children are cached orphans them: they hold memory that no
   lookup from the root can reach until the parent is stored again.
2. Candidates sit in a min-heap of (rank, key); the rank is the last-touch tick
   (prefix-aware, lru) or the tick the page was stored at (fifo). Entries are never
   removed from the middle: an entry is valid only while its page still exists, still
   has that rank, may be evicted under the policy (is a leaf, for prefix-aware) and is
   not leased. Stale entries are skipped when popped and dropped when the heap is
   rebuilt. Every operation is O(log n) amortized.
3. A leased or pinned candidate is dropped when popped; the store offers it again when its
   lease ends or its last pin is released, at its unchanged rank.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Mapping, Protocol


@dataclass(frozen=True)
class EvictionPolicy:
    name: str
    leaves_only: bool  # evict only pages that no cached page names as parent
    requires_parent: bool  # refuse a put whose parent is not cached
    by_last_touch: bool  # order by last touch (LRU); otherwise by the time stored (FIFO)


PREFIX_AWARE = EvictionPolicy("prefix-aware", leaves_only=True, requires_parent=True, by_last_touch=True)
LRU = EvictionPolicy("lru", leaves_only=False, requires_parent=False, by_last_touch=True)
FIFO = EvictionPolicy("fifo", leaves_only=False, requires_parent=False, by_last_touch=False)
POLICIES = {policy.name: policy for policy in (PREFIX_AWARE, LRU, FIFO)}


def get_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}: choose one of {', '.join(POLICIES)}")
    return POLICIES[name]


class Page(Protocol):
    """What the queue reads of a store's page."""

    tick: int  # last touch
    stored_tick: int  # when it was stored
    children: int  # cached pages that name it as parent
    lease_until: float  # 0.0 when not leased
    pins: int  # readers sending the page's bytes straight from the pool right now
    slot: int | None  # its RAM slot; None when it is on disk only (RamQueue)


class EvictionQueue:
    """The pages that may be evicted, first to go at the front (design notes 2 and 3)."""

    def __init__(self, policy: EvictionPolicy, pages: Mapping[bytes, Page]):
        self.policy = policy
        self._pages = pages  # the store's index, read only
        self._heap: list[tuple[int, bytes]] = []

    def rank(self, page: Page) -> int:
        return page.tick if self.policy.by_last_touch else page.stored_tick

    def may_evict(self, page: Page) -> bool:
        """Whether the policy allows evicting `page` once it is unleased."""
        return not (self.policy.leaves_only and page.children)

    def offer(self, key: bytes, page: Page) -> None:
        """Queue `key` at its current rank, if the policy may evict it: stored, or its lease ended."""
        if self.policy.leaves_only and page.children:
            return
        heapq.heappush(self._heap, (self.rank(page), key))
        if len(self._heap) > 2 * len(self._pages) + 64:
            self._heap = [(self.rank(p), k) for k, p in self._pages.items() if self.may_evict(p)]
            heapq.heapify(self._heap)

    def touched(self, key: bytes, page: Page) -> None:
        if self.policy.by_last_touch:
            self.offer(key, page)

    def lost_last_child(self, key: bytes, page: Page) -> None:
        if self.policy.leaves_only:
            self.offer(key, page)

    def pop(self, now: float, protect: bytes) -> bytes | None:
        """The key to evict next (never `protect`), taken off the queue; None when nothing may go."""
        held = []
        victim = None
        heap = self._heap
        while heap:
            rank, key = heapq.heappop(heap)
            page = self._pages.get(key)
            if (page is None or self.rank(page) != rank or not self.may_evict(page) or page.lease_until > now
                    or page.pins):
                continue  # stale entry; a leased or pinned page is offered again when that ends
            if key == protect:
                held.append((rank, key))
                continue
            victim = key
            break
        for entry in held:
            heapq.heappush(heap, entry)
        return victim

    def check(self) -> None:
        entries = set(self._heap)
        for key, page in self._pages.items():
            if self.may_evict(page) and page.lease_until == 0.0 and not page.pins:
                assert (self.rank(page), key) in entries, f"page {key.hex()} cannot be evicted: no queue entry"


class RamQueue:
    """With a disk tier: the pages with a copy in RAM, least recently touched first; which RAM copy
    makes room next. Its page stays on the node, on disk (the store writes it there first if it
    was not yet), so leases do not hold a copy in RAM and any page may go, leaf or not. A pinned
    copy is dropped when popped; the store offers it again when its last pin is released.
    Entries are invalidated lazily as in EvictionQueue (design note 2)."""

    def __init__(self, pages: Mapping[bytes, Page]):
        self._pages = pages  # the store's index, read only
        self._heap: list[tuple[int, bytes]] = []

    def offer(self, key: bytes, page: Page) -> None:
        """Queue `key` at its last touch, if it has a copy in RAM."""
        if page.slot is None:
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
