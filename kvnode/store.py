"""The page store: a preallocated page pool, a content-addressed index, eviction in the
caller's chosen policy (prefix-aware LRU by default) and short leases. Plain Python over
NumPy; knows nothing of gRPC.

Design notes
1. The policy (kvnode/eviction.py) picks victims and says whether a put needs its
   parent cached; the store carries it out. Under prefix-aware, the node's policy, only
   leaves are evicted, least recently used first, and a put whose parent is not cached
   is refused: so every cached page's whole prefix is cached. Under lru and fifo any
   page may go, and a cached page whose parent is not cached is an orphan: the store
   counts them in O(1) per operation, keeping per missing parent how many cached pages
   name it, so a parent stored again adopts its orphans.
2. A put never evicts the parent it names, under every policy.
3. Leases expire lazily: a heap holds (expiry, key); each operation first retires the
   leases that ran out, so an abandoned lease frees itself. A leased page is never
   evicted, under every policy. A renewal leaves its old entry behind, stale; when stale
   entries outnumber live leases (2x + 64), the heap is rebuilt from its live entries, so
   a client renewing in a loop cannot grow it without bound (amortized O(1) per lease).
4. Pins are for the data plane, which sends pages straight from the pool: a pinned page
   is never evicted, so its slot is not overwritten while its bytes are on their way.
   Unlike a lease a pin does not expire: the pinner releases it in a `finally`.
5. Leases are bounded, so no client can hold the pool and starve eviction: a lookup may ask
   to lease at most `max_leases_per_call` keys (more is refused, LeaseRefused: the caller
   sent a request too large), and at most `max_leased_pages` pages are leased at once (the
   node's default: half the pool). A lookup that would pass the total is not refused: it
   renews leases already held and leases new pages while they fit, and its hits stop at
   the first page it could not lease. Refusing would make every client's lookup fail while
   one client holds the leases (a worker then skips the node altogether); answering hits it
   did not lease would send clients to fetch pages that may be gone. So under lease
   pressure a client gets fewer hits and computes the rest: correct, slower, never failed.
6. With a disk tier (kvnode/disk_tier.py) the tiers are inclusive: every page of the node has a
   disk slot, taken when it is stored, and the disk's capacity is the node's; RAM keeps a copy
   of the pages used last. So the node's eviction (note 1) runs over the disk's pages and drops
   a page from the node only as a leaf, and RAM makes room by dropping the copy used least
   recently (kvnode/eviction.py: RamQueue), whatever its place in a chain: the page stays on
   the node. A put lands in RAM, dirty: flush() (every --flush-interval) writes dirty pages to
   their slots, and so does dropping a dirty copy from RAM (demotion). So put acknowledges
   RAM, and disk within the flush interval; with `write_through` it writes the page before it
   answers. A page on disk only is read back into RAM when it is read (promotion) and checked
   against its checksum first; when no RAM slot is free or unpinned it is served from a
   buffer of its own, not promoted.
7. A page whose bytes on disk fail their checksum is never served: it is dropped with its
   descendants (unreachable without it); a descendant pinned at that moment goes when its
   last pin is released. At start the index is rebuilt from the slots (kvnode/recovery.py).
"""

from __future__ import annotations

import enum
import heapq
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from kvnode.disk_tier import DiskTier
from kvnode.eviction import PREFIX_AWARE, EvictionPolicy, EvictionQueue, RamQueue, get_policy
from kvnode.recovery import Recovered, recover

log = logging.getLogger("kvnode")

KEY_BYTES = 16
MAX_LEASE_MS = 60_000


class InvalidRequest(ValueError):
    """The caller sent something malformed; nothing was changed."""


class LeaseRefused(Exception):
    """A lookup asked to lease more pages in one call than the node allows; nothing was changed."""


class PageNotFound(KeyError):
    """A requested page is not cached."""

    def __init__(self, key: bytes):
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"page {self.key.hex()} is not cached (evicted or never stored): look it up again"


class PutOutcome(enum.IntEnum):
    """Values match the wire enum kvcache.v1.PutReply.Outcome."""

    STORED = 1
    ALREADY_PRESENT = 2
    REFUSED_NO_PARENT = 3
    REFUSED_NO_ROOM = 4


@dataclass(slots=True)
class _Page:
    slot: int | None  # its RAM slot; None when on disk only
    parent: bytes  # b"" for a root page
    tick: int  # last touch
    stored_tick: int
    children: int = 0  # cached pages that name it as parent
    lease_until: float = 0.0
    pins: int = 0  # readers sending straight from its slot (pin_pages)
    disk_slot: int | None = None  # with a disk tier: its slot there (design note 6)
    dirty: bool = False  # in RAM, not yet written to its disk slot


@dataclass
class StoreStats:
    lookups: int = 0
    hit_pages: int = 0
    miss_pages: int = 0
    puts: int = 0
    stored_pages: int = 0
    evictions: int = 0
    refusals: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    get_pages: int = 0
    lease_limited: int = 0  # lookups whose hits the leased-pages bound cut short
    disk_reads: int = 0  # pages read from the disk tier (promotions and served from disk)
    disk_writes: int = 0  # pages written to the disk tier (flushes, demotions, write-through)
    promotions: int = 0  # pages read from disk into RAM
    demotions: int = 0  # RAM copies dropped to make room (the page stays on disk)
    corrupted_dropped: int = 0  # pages whose bytes on disk failed their checksum, at start or read
    orphans_dropped: int = 0  # intact pages dropped because an ancestor was corrupted or lost
    recovered_pages: int = 0  # pages found intact on disk at start
    recovery_seconds: float = 0.0


def check_key(key: bytes, what: str = "key") -> None:
    if len(key) != KEY_BYTES:
        raise InvalidRequest(f"{what} must be {KEY_BYTES} bytes, got {len(key)}")


class PageStore:
    """A fixed pool of `capacity_pages` pages of `page_bytes` each, safe to share between threads.

    `policy` is an eviction policy's name ("prefix-aware", "lru", "fifo"; kvnode/eviction.py).
    `max_leased_pages` and `max_leases_per_call` bound leases (design note 5); None: no bound.
    With a `disk` tier (design notes 6 and 7) the node holds `disk.capacity_pages` pages, RAM a
    copy of up to `capacity_pages` of them; its pages are recovered from it at once.
    """

    def __init__(self, capacity_pages: int, page_bytes: int, clock: Callable[[], float] = time.monotonic,
                 policy: str = PREFIX_AWARE.name, max_leased_pages: int | None = None,
                 max_leases_per_call: int | None = None, disk: DiskTier | None = None,
                 write_through: bool = False):
        if disk is not None and disk.page_bytes != page_bytes:
            raise ValueError(f"the disk tier holds pages of {disk.page_bytes} bytes, the store {page_bytes}")
        self.ram_capacity_pages = capacity_pages
        capacity_pages = disk.capacity_pages if disk is not None else capacity_pages
        if capacity_pages < 1:
            raise ValueError(f"capacity must be at least one page, got {capacity_pages}")
        if page_bytes < 1:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        if max_leased_pages is not None and not 0 <= max_leased_pages <= capacity_pages:
            raise ValueError(f"max_leased_pages must be between 0 and the capacity {capacity_pages}, "
                             f"got {max_leased_pages}")
        if max_leases_per_call is not None and max_leases_per_call < 1:
            raise ValueError(f"max_leases_per_call must be at least 1, got {max_leases_per_call}")
        self.max_leased_pages = capacity_pages if max_leased_pages is None else max_leased_pages
        self.max_leases_per_call = max_leases_per_call
        self.capacity_pages = capacity_pages
        self.page_bytes = page_bytes
        self.clock = clock
        self.policy: EvictionPolicy = get_policy(policy)
        self.stats = StoreStats()
        self._pool = np.zeros((self.ram_capacity_pages, page_bytes), dtype=np.uint8)
        self._pool.fill(0)  # touch every page now, so serving never waits on the kernel
        self._free_slots: list[int] = list(range(self.ram_capacity_pages - 1, -1, -1))  # RAM slots
        self._index: dict[bytes, _Page] = {}
        self._queue = EvictionQueue(self.policy, self._index)
        self.disk = disk
        self.write_through = write_through
        self._ram_queue = RamQueue(self._index) if disk is not None else None
        self._free_disk_slots: list[int] = []
        self._dirty: dict[bytes, None] = {}  # pages to write to disk, in the order stored
        self._seq = 0  # write sequence of the disk tier's headers
        self._orphans_by_parent: dict[bytes, int] = {}  # missing parent key -> cached pages naming it
        self._num_orphans = 0
        self._lease_heap: list[tuple[float, bytes]] = []
        self._num_leased = 0
        self._tick = 0
        self._lock = threading.Lock()
        self.recovered: Recovered | None = None
        if disk is not None:
            self._recover(disk)

    def _recover(self, disk: DiskTier) -> None:
        found = self.recovered = recover(disk)
        self._free_disk_slots = found.free_slots
        for header in found.pages:
            self._add(header.key, header.parent, None, disk_slot=header.slot)
            self._seq = max(self._seq, header.seq)
        self.stats.recovered_pages = len(found.pages)
        self.stats.corrupted_dropped = found.corrupted
        self.stats.orphans_dropped = found.orphaned
        self.stats.recovery_seconds = found.seconds

    # ---- queries -------------------------------------------------------------

    def num_used(self) -> int:
        return len(self._index)

    def num_free(self) -> int:
        """Pages the node can still take without evicting (with a disk tier: free disk slots)."""
        return len(self._free_disk_slots) if self.disk is not None else len(self._free_slots)

    def num_in_ram(self) -> int:
        return self.ram_capacity_pages - len(self._free_slots)

    def num_on_disk(self) -> int:
        """Pages written to the disk tier (its slots hold them whole); 0 without one."""
        with self._lock:
            return 0 if self.disk is None else len(self._index) - len(self._dirty)

    def num_dirty(self) -> int:
        """Pages in RAM not yet written to their disk slot."""
        return len(self._dirty)

    def num_leased(self) -> int:
        with self._lock:
            self._retire_leases(self.clock())
            return self._num_leased

    def lease_heap_size(self) -> int:
        """Entries in the lease heap, live and stale (tests watch it stay bounded)."""
        with self._lock:
            return len(self._lease_heap)

    def num_orphans(self) -> int:
        """Cached pages whose parent is not cached (always 0 under prefix-aware)."""
        return self._num_orphans

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    # ---- operations ----------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], lease_ms: int = 0) -> int:
        """Length of the longest cached prefix of `keys`; touches it, and leases it when lease_ms > 0."""
        return self.lookup_and_lease(keys, lease_ms)[0]

    def lookup_and_lease(self, keys: Sequence[bytes], lease_ms: int = 0) -> tuple[int, bool]:
        """(hits, cut): as lookup; `cut` says the leased-pages bound stopped the hits short (note 5)."""
        for key in keys:
            check_key(key)
        if not 0 <= lease_ms <= MAX_LEASE_MS:
            raise InvalidRequest(f"lease_ms must be between 0 and {MAX_LEASE_MS}, got {lease_ms}")
        if lease_ms and self.max_leases_per_call is not None and len(keys) > self.max_leases_per_call:
            raise LeaseRefused(f"a lookup asked to lease up to {len(keys)} pages; this node leases at most "
                               f"{self.max_leases_per_call} per call: look up fewer keys per call")
        with self._lock:
            now = self.clock()
            self._retire_leases(now)
            hits, cut = 0, False
            for key in keys:
                page = self._index.get(key)
                if page is None:
                    break
                if lease_ms and page.lease_until == 0.0 and self._num_leased >= self.max_leased_pages:
                    cut = True
                    break
                self._touch(key, page)
                if lease_ms:
                    self._lease(key, page, now + lease_ms / 1000.0)
                hits += 1
            self.stats.lookups += 1
            self.stats.hit_pages += hits
            self.stats.miss_pages += len(keys) - hits
            self.stats.lease_limited += cut
            return hits, cut

    def check_cached(self, keys: Iterable[bytes]) -> None:
        """Raise PageNotFound for the first key that is not cached (so a fetch fails before it starts)."""
        with self._lock:
            for key in keys:
                if key not in self._index:
                    raise PageNotFound(key)

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
        (or its bytes on disk turn out corrupted: design note 7)."""
        with self._lock:
            return [view.toreadonly() for view in self._pin(keys)]

    def unpin_pages(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._unpin(keys)

    def num_pinned(self) -> int:
        with self._lock:
            return sum(1 for page in self._index.values() if page.pins)

    def put(self, key: bytes, parent: bytes, data) -> PutOutcome:
        """Store one page whose parent is `parent` (b"" for a root page)."""
        self.validate_put(key, parent, data)
        with self._lock:
            now = self.clock()
            self._retire_leases(now)
            self.stats.puts += 1
            page = self._index.get(key)
            if page is not None:
                self._touch(key, page)
                return PutOutcome.ALREADY_PRESENT
            if parent and self.policy.requires_parent and parent not in self._index:
                self.stats.refusals += 1
                return PutOutcome.REFUSED_NO_PARENT
            slot = self._take_slot(now, protect=parent)
            if slot is None:
                self.stats.refusals += 1
                return PutOutcome.REFUSED_NO_ROOM
            if self.disk is None:
                self._pool[slot] = np.frombuffer(data, dtype=np.uint8)
                self._add(key, parent, slot)
            else:
                self._put_tiered(key, parent, data, disk_slot=slot)
            self.stats.stored_pages += 1
            self.stats.bytes_in += self.page_bytes  # pages stored, not pages offered
            return PutOutcome.STORED

    def validate_put(self, key: bytes, parent: bytes, data) -> None:
        check_key(key)
        if parent:
            check_key(parent, "parent key")
        if parent == key:
            raise InvalidRequest(f"page {key.hex()} names itself as its parent")
        size = memoryview(data).nbytes
        if size != self.page_bytes:
            raise InvalidRequest(f"page {key.hex()} has {size} bytes; this node stores pages of {self.page_bytes} bytes")

    def flush(self) -> int:
        """Write the dirty pages to their disk slots (design note 6), then sync the file; how many.
        The writes run outside the lock, the pages pinned meanwhile."""
        if self.disk is None:
            return 0
        with self._lock:
            batch = []
            for key in self._dirty:
                page = self._index[key]
                page.pins += 1
                batch.append((key, page, self._next_seq()))
            self._dirty.clear()
        written = 0
        try:
            for key, page, seq in batch:
                self.disk.write(page.disk_slot, key, page.parent, seq, self._pool[page.slot])
                written += 1
            if batch:
                self.disk.sync()
        finally:
            with self._lock:
                self.stats.disk_writes += written
                for number, (key, page, _) in enumerate(batch):
                    if number < written:
                        page.dirty = False
                    else:
                        self._dirty[key] = None  # a write failed: try again at the next flush
                self._unpin([key for key, _, _ in batch])
        return written

    # ---- internals (callers hold the lock) -----------------------------------

    def _touch(self, key: bytes, page: _Page) -> None:
        self._tick += 1
        page.tick = self._tick
        self._queue.touched(key, page)
        if self._ram_queue is not None:
            self._ram_queue.offer(key, page)

    def _add(self, key: bytes, parent: bytes, slot: int | None, disk_slot: int | None = None) -> _Page:
        """Index a new page in `slot`: a cached parent is touched first; a missing one makes it an orphan."""
        parent_page = self._index.get(parent) if parent else None
        if parent_page is not None:
            parent_page.children += 1
            self._touch(parent, parent_page)
        elif parent:
            self._orphans_by_parent[parent] = self._orphans_by_parent.get(parent, 0) + 1
            self._num_orphans += 1
        adopted = self._orphans_by_parent.pop(key, 0)  # pages stored while this one was missing
        self._num_orphans -= adopted
        self._tick += 1
        page = _Page(slot=slot, parent=parent, tick=self._tick, stored_tick=self._tick, children=adopted,
                     disk_slot=disk_slot)
        self._index[key] = page
        self._queue.offer(key, page)
        if self._ram_queue is not None:
            self._ram_queue.offer(key, page)
        return page

    def _put_tiered(self, key: bytes, parent: bytes, data, disk_slot: int) -> None:
        """A new page into RAM, dirty, or straight to disk (write-through, or no RAM slot to be had)."""
        slot = self._take_ram_slot()
        page = self._add(key, parent, slot, disk_slot=disk_slot)
        if slot is not None:
            self._pool[slot] = np.frombuffer(data, dtype=np.uint8)
        if slot is None or self.write_through:
            self._write(key, page, data)
        else:
            page.dirty = True
            self._dirty[key] = None

    def _write(self, key: bytes, page: _Page, data) -> None:
        self.disk.write(page.disk_slot, key, page.parent, self._next_seq(), data)
        self.stats.disk_writes += 1

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _pin(self, keys: Sequence[bytes]) -> list[memoryview]:
        """Views of the pages' bytes, each pinned (read from disk first when it is there only);
        all or nothing: PageNotFound unpins what it pinned."""
        pages = []
        for key in keys:
            page = self._index.get(key)
            if page is None:
                raise PageNotFound(key)
            pages.append(page)
        views: list[memoryview] = []
        try:
            for key, page in zip(keys, pages):
                views.append(self._bytes_of(key, page))
                self._touch(key, page)
                page.pins += 1
        except PageNotFound:
            self._unpin(keys[: len(views)])
            raise
        self.stats.get_pages += len(keys)
        self.stats.bytes_out += self.page_bytes * len(keys)
        return views

    def _unpin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            page = self._index[key]  # a pinned page is never evicted
            assert page.pins > 0, f"page {key.hex()} unpinned more often than pinned"
            page.pins -= 1
            if page.pins:
                continue
            if page.parent and page.parent not in self._index and self.policy.requires_parent:
                self._drop_subtree(key)  # its parent was dropped corrupted while it was pinned
                continue
            if page.lease_until == 0.0:
                self._queue.offer(key, page)
            if self._ram_queue is not None:
                self._ram_queue.offer(key, page)

    def _bytes_of(self, key: bytes, page: _Page) -> memoryview:
        """The page's bytes: its RAM slot, promoted there from disk first when it is on disk only."""
        if page.slot is not None:
            return memoryview(self._pool[page.slot])
        slot = self._take_ram_slot()
        out = self._pool[slot] if slot is not None else np.empty(self.page_bytes, dtype=np.uint8)
        self.stats.disk_reads += 1
        if not self.disk.read(page.disk_slot, key, out):
            if slot is not None:
                self._free_slots.append(slot)
            self._drop_corrupted(key)
            raise PageNotFound(key)
        if slot is not None:
            page.slot = slot  # queued for RAM by the touch that follows (_pin)
            self.stats.promotions += 1
        return memoryview(out)

    def _drop_corrupted(self, key: bytes) -> None:
        dropped = self._drop_subtree(key)
        self.stats.corrupted_dropped += 1
        self.stats.orphans_dropped += dropped - 1
        log.warning("page %s failed its checksum on disk: dropped it and %d descendants", key.hex(), dropped - 1)

    def _drop_subtree(self, key: bytes) -> int:
        """Drop `key` and its descendants from the node (a pinned one waits for its last unpin); how many."""
        children: dict[bytes, list[bytes]] = {}
        for k, p in self._index.items():
            if p.parent:
                children.setdefault(p.parent, []).append(k)
        order = [key]
        for k in order:
            order.extend(children.get(k, ()))
        dropped = 0
        for k in reversed(order):  # leaves first
            if self._index[k].pins:
                continue
            self._evict(k, counted=False)
            dropped += 1
        return dropped

    def _lease(self, key: bytes, page: _Page, until: float) -> None:
        if until <= page.lease_until:
            return
        if page.lease_until == 0.0:
            self._num_leased += 1
        page.lease_until = until
        heapq.heappush(self._lease_heap, (until, key))
        if len(self._lease_heap) > 2 * self._num_leased + 64:
            self._compact_leases()

    def _compact_leases(self) -> None:
        """Drop the heap's stale entries (design note 3): O(heap), after as many renewals."""
        index = self._index
        live = [(until, key) for until, key in self._lease_heap
                if (page := index.get(key)) is not None and page.lease_until == until]
        heapq.heapify(live)
        self._lease_heap = live

    def _retire_leases(self, now: float) -> None:
        heap = self._lease_heap
        while heap and heap[0][0] <= now:
            until, key = heapq.heappop(heap)
            page = self._index.get(key)
            if page is None or page.lease_until != until:
                continue  # renewed since, or gone
            page.lease_until = 0.0
            self._num_leased -= 1
            if not page.pins:
                self._queue.offer(key, page)

    def _take_slot(self, now: float, protect: bytes) -> int | None:
        """A free slot of the node (with a disk tier: a disk slot), evicting the policy's next
        unleased victim (never `protect`) if needed."""
        free = self._free_slots if self.disk is None else self._free_disk_slots
        if not free:
            victim = self._queue.pop(now, protect)
            if victim is None:
                return None
            self._evict(victim)
        return free.pop()

    def _take_ram_slot(self) -> int | None:
        """With a disk tier: a free RAM slot, demoting the least recently used copy if needed; None
        when every copy is pinned."""
        if not self._free_slots:
            victim = self._ram_queue.pop()
            if victim is None:
                return None
            self._demote(victim)
        return self._free_slots.pop()

    def _demote(self, key: bytes) -> None:
        page = self._index[key]
        if page.dirty:
            self._write(key, page, self._pool[page.slot])
            page.dirty = False
            del self._dirty[key]
        self._free_slots.append(page.slot)
        page.slot = None
        self.stats.demotions += 1

    def _evict(self, key: bytes, counted: bool = True) -> None:
        """Drop `key` from the node, its slots back to the free lists."""
        page = self._index.pop(key)
        self.stats.evictions += counted
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
        if page.slot is not None:
            self._free_slots.append(page.slot)
        if page.disk_slot is not None:
            self._dirty.pop(key, None)
            self.disk.free(page.disk_slot)
            self._free_disk_slots.append(page.disk_slot)

    # ---- invariants (tests call this after every step) -----------------------

    def check_invariants(self) -> None:
        with self._lock:
            self._check_tiers()
            children: dict[bytes, int] = {}
            orphans: dict[bytes, int] = {}
            for key, page in self._index.items():
                if page.parent in self._index:
                    children[page.parent] = children.get(page.parent, 0) + 1
                elif page.parent:
                    assert not self.policy.requires_parent or page.pins, f"page {key.hex()} is cached, its parent not"
                    orphans[page.parent] = orphans.get(page.parent, 0) + 1
            for key, page in self._index.items():
                assert page.children == children.get(key, 0), f"page {key.hex()} child count is off"
            assert orphans == self._orphans_by_parent, "orphan counts per missing parent are off"
            assert self._num_orphans == sum(orphans.values()), f"orphan count {self._num_orphans} is off"
            leased = sum(1 for p in self._index.values() if p.lease_until > 0.0)
            assert leased == self._num_leased, f"leased count {self._num_leased} != {leased}"
            assert leased <= self.max_leased_pages, f"{leased} pages leased, over the bound {self.max_leased_pages}"
            live = {(p.lease_until, k) for k, p in self._index.items() if p.lease_until > 0.0}
            assert live <= set(self._lease_heap), "a leased page has no lease heap entry"
            self._queue.check()
            if self._ram_queue is not None:
                self._ram_queue.check()

    def _check_tiers(self) -> None:
        """used + free = capacity on every tier; no slot both free and used, or used twice."""
        pages = self._index.values()
        ram = [p.slot for p in pages if p.slot is not None]
        tiers = [("RAM", ram, self._free_slots, self.ram_capacity_pages)]
        if self.disk is None:
            assert len(ram) == len(self._index), "a page is not in RAM, and there is no disk tier"
        else:
            disk = [p.disk_slot for p in pages]
            assert None not in disk, "a page has no disk slot"
            tiers.append(("disk", disk, self._free_disk_slots, self.capacity_pages))
            dirty = {k for k, p in self._index.items() if p.dirty}
            assert dirty == set(self._dirty), "the dirty list is off"
            assert all(self._index[k].slot is not None for k in dirty), "a dirty page has no RAM copy"
        for name, used, free, capacity in tiers:
            assert len(used) + len(free) == capacity, f"{name}: used {len(used)} + free {len(free)} != {capacity}"
            assert len(set(used)) == len(used), f"{name}: two pages share a slot"
            assert not set(used) & set(free), f"{name}: a slot is both free and used"
            assert len(set(free)) == len(free), f"{name}: a slot is free twice"
