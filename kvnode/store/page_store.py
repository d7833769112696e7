"""The page store: a preallocated page pool, a content-addressed index, eviction in the caller's
chosen policy (prefix-aware LRU by default) and short leases; plain Python over NumPy, no gRPC.
Its pieces are objects it holds: leases.py, orphans.py, pins.py, drops.py, tiers.py (with a disk
tier, where each page's copies are), invariants.py, and types.py (errors, page record, counters);
the victims' order is kvnode/eviction/'s.

The policy picks victims and says whether a put needs its parent cached; the store carries it
out. Under prefix-aware, the node's policy, only leaves are evicted and a put whose parent is not
cached is refused, so every cached page's whole prefix is cached; lru and fifo leave orphans
(orphans.py). Under every policy a leased or pinned page is never evicted.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Sequence

import numpy as np

from base.pages import KEY_BYTES
from kvnode.store import invariants as store_invariants
from kvnode.wire.checksum import CHECKSUM_BYTES, page_checksum
from kvnode.disk.tier import DiskTier
from kvnode.eviction import PREFIX_AWARE, EvictionPolicy, EvictionQueue, get_policy
from kvnode.wire.keys import InvalidRequest, check_key
from kvnode.store.leases import Leases
from kvnode.store.orphans import Orphans
from kvnode.disk.recovery import Recovered, recover
from kvnode.wire.shared_pool import make_pool
from kvnode.store.drops import PageDrops
from kvnode.store.pins import PagePins
from kvnode.store.types import MAX_LEASE_MS, LeaseRefused, PageNotFound, PutOutcome, StoreStats, _Page
from kvnode.store.tiers import Tiers


class PageStore:
    """A fixed pool of `capacity_pages` pages of `page_bytes` each, safe to share between threads.

    `policy` is an eviction policy's name ("prefix-aware", "lru", "fifo"; kvnode/eviction/).
    `max_leased_pages` and `max_leases_per_call` bound leases (see lookup_and_lease); None: no bound.
    With a `disk` tier the tiers are inclusive: every page has a disk slot, taken when it is
    stored, so the node holds `disk.capacity_pages` pages and evicts over them; RAM keeps a copy of
    up to `capacity_pages` of those used last (tiers.py). Its pages are recovered from it at once.
    `shared_pool` puts the RAM pool in shared memory (`self.shared_pool`) for readers on this host.
    """

    def __init__(self, capacity_pages: int, page_bytes: int, clock: Callable[[], float] = time.monotonic,
                 policy: str = PREFIX_AWARE.name, max_leased_pages: int | None = None,
                 max_leases_per_call: int | None = None, disk: DiskTier | None = None,
                 write_through: bool = False, shared_pool: bool = False):
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
        self.max_leased_pages = capacity_pages if max_leased_pages is None else max_leased_pages  # see lookup_and_lease
        self.max_leases_per_call = max_leases_per_call
        self.capacity_pages = capacity_pages
        self.page_bytes = page_bytes
        self.clock = clock
        self.policy: EvictionPolicy = get_policy(policy)
        self.stats = StoreStats()
        # In shared memory for readers on this host when asked (kvnode/wire/shared_pool.py); touched now.
        self._pool, self.shared_pool = make_pool(self.ram_capacity_pages, page_bytes, shared_pool)
        self._pool_bytes = memoryview(self._pool).cast("B").toreadonly()  # slot n's bytes: _ram_bytes_of
        self._free_slots: list[int] = list(range(self.ram_capacity_pages - 1, -1, -1))  # RAM slots
        self._index: dict[bytes, _Page] = {}
        self._queue = EvictionQueue(self.policy, self._index)
        self.disk = disk
        self._tiers = (Tiers(disk, self._pool, self._free_slots, self._index, self.stats, self._drop_lost,
                             write_through) if disk is not None else None)
        self._orphans = Orphans()
        self._leases = Leases(self._index, self.max_leased_pages)
        bytes_of = self._ram_bytes_of if self._tiers is None else self._tiers.bytes_of
        ram_queue = None if self._tiers is None else self._tiers.ram_queue
        self._drops = PageDrops(self._index, self._queue, self._leases, self._orphans, self._free_slots,
                                self._tiers, bytes_of, self.stats)
        self._pins = PagePins(self._index, self._queue, ram_queue, self._drops, bytes_of,
                              self._touch_pinned, self.stats, page_bytes)
        self._tick = 0
        self._lock = threading.Lock()
        self.recovered: Recovered | None = None
        if disk is not None:
            self._recover(disk)

    def _recover(self, disk: DiskTier) -> None:
        found = self.recovered = recover(disk)
        for header in found.pages:
            self._add(header.key, header.parent, header.checksum_of_page, None, disk_slot=header.slot)
        self._tiers.recovered(max((h.seq for h in found.pages), default=0), found.free_slots)
        self.stats.recovered_pages = len(found.pages)
        self.stats.corrupted_dropped = found.corrupted
        self.stats.orphans_dropped = found.orphaned
        self.stats.recovery_seconds = found.seconds

    # ---- queries -------------------------------------------------------------

    def num_used(self) -> int:
        return len(self._index)

    def num_free(self) -> int:
        """Pages the node can still take without evicting (with a disk tier: free disk slots)."""
        return len(self._tiers.free_disk_slots) if self._tiers is not None else len(self._free_slots)

    def num_in_ram(self) -> int:
        return self.ram_capacity_pages - len(self._free_slots)

    def num_on_disk(self) -> int:
        """Pages written to the disk tier (its slots hold them whole; not those a flush is still
        writing); 0 without one."""
        with self._lock:
            return 0 if self._tiers is None else len(self._index) - self._tiers.num_not_on_disk()

    def num_dirty(self) -> int:
        """Pages in RAM not yet written to their disk slot (a flush under way included)."""
        with self._lock:
            return 0 if self._tiers is None else self._tiers.num_not_on_disk()

    def num_leased(self) -> int:
        with self._lock:
            self._retire_leases(self.clock())
            return self._leases.num_leased

    def lease_heap_size(self) -> int:
        """Entries in the lease heap, live and stale (tests watch it stay bounded)."""
        with self._lock:
            return self._leases.heap_size()

    def num_orphans(self) -> int:
        """Cached pages whose parent is not cached (always 0 under prefix-aware)."""
        return self._orphans.num_orphans

    def num_pinned(self) -> int:
        with self._lock:
            return self._pins.num_pinned()

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
        """(hits, cut): as lookup; `cut` says the leased-pages bound stopped the hits short.

        Leases are bounded so no client can hold the pool and starve eviction: more than
        `max_leases_per_call` keys is refused (LeaseRefused), but a lookup past `max_leased_pages`
        is not: it leases while they fit, its hits stopping at the first page it could not lease.
        Refusing would fail every client while one holds the leases; answering hits it did not
        lease would send clients after pages that may be gone. Under lease pressure a client
        computes more, and never fails."""
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
                if lease_ms and not self._leases.can_lease(page):
                    cut = True
                    break
                self._touch(key, page)
                if lease_ms:
                    self._leases.lease(key, page, now + lease_ms / 1000.0)
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

    def checksums(self, keys: Sequence[bytes]) -> list[bytes]:
        """The pages' writers' checksums, in order; PageNotFound for a key not cached."""
        with self._lock:
            try:
                return [self._index[key].checksum for key in keys]
            except KeyError as exc:
                raise PageNotFound(exc.args[0]) from None

    def put(self, key: bytes, parent: bytes, data, checksum: bytes | None = None) -> PutOutcome:
        """Store one page whose parent is `parent` (b"" for a root page); a put never evicts the
        parent it names. `checksum`: its writer's, kept as sent and not checked, since the reader
        checks the bytes (one xxh3 pass per page, the writer's, keeps puts fast); None: computed here.
        With a disk tier the page lands in RAM, dirty, written to its slot by flush() or when its
        copy is dropped, or before the put answers with `write_through`."""
        self._validate_shape(key, parent, data)
        if checksum is None:
            checksum = page_checksum(key, data)
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
            slot = self._take_slot(now, protect=parent) if key not in self._drops.condemned else None
            if slot is None:
                self.stats.refusals += 1
                return PutOutcome.REFUSED_NO_ROOM
            if self._tiers is None:
                self._pool[slot] = np.frombuffer(data, dtype=np.uint8)
                self._add(key, parent, checksum, slot)
            else:
                ram_slot = self._tiers.place(key, parent, checksum, slot, data)
                if ram_slot is False:  # the disk failed it (logged): as if there were no room
                    self._tiers.free_disk_slots.append(slot)
                    self.stats.refusals += 1
                    return PutOutcome.REFUSED_NO_ROOM
                self._tiers.landed(key, self._add(key, parent, checksum, ram_slot, disk_slot=slot))
            self.stats.stored_pages += 1
            self.stats.bytes_in += self.page_bytes  # pages stored, not pages offered
            return PutOutcome.STORED

    def validate_put(self, key: bytes, parent: bytes, data, checksum: bytes | None = None) -> None:
        """InvalidRequest when the page cannot be stored as sent (its checksum is not checked
        against its bytes here: see put)."""
        self._validate_shape(key, parent, data)
        if checksum is not None and len(checksum) != CHECKSUM_BYTES:
            raise InvalidRequest(f"page {key.hex()}: a checksum is {CHECKSUM_BYTES} bytes, got {len(checksum)}")

    def _validate_shape(self, key: bytes, parent: bytes, data) -> None:
        check_key(key)
        if parent:
            check_key(parent, "parent key")
        if parent == key:
            raise InvalidRequest(f"page {key.hex()} names itself as its parent")
        size = memoryview(data).nbytes
        if size != self.page_bytes:
            raise InvalidRequest(f"page {key.hex()} has {size} bytes; this node stores pages of {self.page_bytes} bytes")

    def flush(self) -> int:
        """Write the dirty pages to their disk slots, then sync the file; how many.
        The writes run outside the lock, the pages pinned meanwhile; a failed write is logged and
        its pages stay dirty (kvnode/store/tiers.py)."""
        if self._tiers is None:
            return 0
        with self._lock:
            batch = self._tiers.take_dirty()
            for _, page, _ in batch:
                page.pins += 1
        written = 0
        try:
            written = self._tiers.write_batch(batch)
        finally:
            with self._lock:
                try:
                    self._tiers.flushed(batch, written)
                finally:  # pins never outlive a flush, whatever fails
                    self._pins.unpin([key for key, _, _ in batch])
        return written

    # ---- pins and drops (kvnode/store/pins.py, kvnode/store/drops.py) -------

    def read(self, keys: Sequence[bytes], prefix: bytes = b"") -> bytes:
        """`prefix` (a caller's framing) and the pages' bytes, back to back, in one copy; touches them."""
        with self._lock:
            return self._pins.read(keys, prefix)

    def pin_pages(self, keys: Sequence[bytes]) -> list[memoryview]:
        """Read-only views of the pages' bytes in the pool, pinned until unpin_pages(keys);
        touches them and counts them as sent. Nothing is pinned when a key is not cached
        (or its bytes on disk turn out corrupted, and it is dropped)."""
        with self._lock:
            return self._pins.pin(keys)

    def pin_slots(self, keys: Sequence[bytes]) -> tuple[list[int | None], list[memoryview]]:
        """pin_pages for a reader of the shared pool (kvnode/wire/shared_pool.py): each page's RAM slot,
        or None for one served from a buffer of its own (on disk only, no RAM slot to be had),
        whose bytes the reader must be sent, and pin_pages' views. Pinned until unpin_pages(keys)."""
        with self._lock:
            views = self._pins.pin(keys)
            return [self._index[key].slot for key in keys], views

    def unpin_pages(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._pins.unpin(keys)

    def drop_reported(self, key: bytes) -> int:
        """A reader found page `key`'s bytes do not match its checksum: drop it and its descendants
        when the node's own bytes fail it too; how many went, 0 when it is not cached or is intact
        here (so a reader cannot drop good pages, only report bad ones)."""
        check_key(key)
        with self._lock:
            return self._drops.drop_reported(key)

    # ---- internals (callers hold the lock) -----------------------------------

    def _touch(self, key: bytes, page: _Page) -> None:
        self._touch_pinned(key, page)
        if self._tiers is not None:
            self._tiers.ram_queue.offer(key, page)

    def _touch_pinned(self, key: bytes, page: _Page) -> None:
        """_touch, but for the RAM queue: a pinned page's last unpin queues it there."""
        self._tick += 1
        page.tick = self._tick
        self._queue.touched(key, page)

    def _add(self, key: bytes, parent: bytes, checksum: bytes, slot: int | None,
             disk_slot: int | None = None) -> _Page:
        """Index a new page in `slot`: a cached parent is touched first; a missing one makes it an orphan."""
        parent_page = self._index.get(parent) if parent else None
        if parent_page is not None:
            parent_page.children += 1
            self._touch(parent, parent_page)
        elif parent:
            self._orphans.add(parent)
        adopted = self._orphans.adopt(key)  # pages stored while this one was missing
        self._tick += 1
        page = _Page(slot=slot, parent=parent, checksum=checksum, tick=self._tick, stored_tick=self._tick, children=adopted,
                     disk_slot=disk_slot)
        self._index[key] = page
        self._queue.offer(key, page)
        if self._tiers is not None:
            self._tiers.ram_queue.offer(key, page)
        return page

    def _ram_bytes_of(self, key: bytes, page: _Page) -> memoryview:
        """The bytes of `page`, in RAM (there is no disk tier), read-only."""
        start = page.slot * self.page_bytes
        return self._pool_bytes[start : start + self.page_bytes]

    def _drop_lost(self, key: bytes, why: str, corrupted: bool) -> None:
        """The disk tier lost `key` (its slot failed its check, or cannot be read): it goes with its
        descendants."""
        self._drops.drop_lost(key, why, corrupted)

    def _retire_leases(self, now: float) -> None:
        """Leases expire lazily: each operation first retires those that ran out, so an abandoned
        lease frees itself."""
        self._leases.retire(now, self._lease_ended)

    def _lease_ended(self, key: bytes, page: _Page) -> None:
        if not page.pins:
            self._queue.offer(key, page)

    def _take_slot(self, now: float, protect: bytes) -> int | None:
        """A free slot of the node (with a disk tier: a disk slot), evicting the policy's next
        unleased victim (never `protect`) if needed."""
        free = self._free_slots if self._tiers is None else self._tiers.free_disk_slots
        if not free:
            victim = self._queue.pop(now, protect)
            if victim is None:
                return None
            self._drops.evict(victim)
        return free.pop()

    # ---- invariants (tests call this after every step) -----------------------

    def check_invariants(self) -> None:
        """AssertionError unless the index, its counts, the leases, the queues and the slots of
        every tier agree (kvnode/store/invariants.py)."""
        with self._lock:
            store_invariants.check(self)
