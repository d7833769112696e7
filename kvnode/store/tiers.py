"""With a disk tier: where a page's copies are, and moving them between RAM and disk. The tiers
are inclusive: every page has a disk slot, RAM a copy of those used last. The store
(kvnode/store/page_store.py) indexes pages and decides which leave the node; this module keeps their
RAM copies and disk slots: a put landing in RAM dirty (or written through), the flush's
bookkeeping, a RAM copy dropped to make room (demotion), a page read back from disk and checked
(promotion), and the disk's I/O errors. Callers hold the store's lock, but for write_batch.

An I/O error of the disk (EIO, ENOSPC, ...) costs the pages it touches, never the node: one log
line, and the page is treated as not on disk.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

import numpy as np

from kvnode.disk.tier import CHECK_ALWAYS, DiskTier
from kvnode.eviction import RamQueue
from kvnode.eviction.candidates import Page

log = logging.getLogger("kvnode")


class Tiers:
    """RAM copies (slots of `pool`, free ones in `free_slots`, both the store's) and disk slots of
    the pages in `index`; `lose(key, why, corrupted)` drops a page the disk lost (corrupted, or
    unreadable), with its descendants."""

    def __init__(self, disk: DiskTier, pool: np.ndarray, free_slots: list[int], index: Mapping[bytes, Page],
                 stats, lose: Callable[[bytes, str, bool], None], write_through: bool = False):
        self.disk = disk
        self.write_through = write_through
        self.ram_queue = RamQueue(index)
        self.free_disk_slots: list[int] = []
        self.dirty: dict[bytes, None] = {}  # pages to write to disk, in the order stored
        # Taken by a flush, written outside the lock; only once written do they count as on disk, so
        # num_on_disk() never counts a page whose write is still under way (or failed).
        self.flushing: set[bytes] = set()
        self._pool = pool
        self._page_bytes = disk.page_bytes
        self._flat = memoryview(pool).cast("B")  # slot n: [n * page_bytes, (n + 1) * page_bytes)
        self._free_slots = free_slots
        self._index = index
        self._stats = stats
        self._lose = lose
        self._seq = 0  # write sequence of the disk tier's headers

    def recovered(self, seq: int, free_disk_slots: list[int]) -> None:
        self._seq = max(self._seq, seq)
        self.free_disk_slots = free_disk_slots

    def num_not_on_disk(self) -> int:
        """Indexed pages not (yet) written: dirty, or in a flush under way."""
        return len(self.dirty) + sum(1 for key in self.flushing if key in self._index)

    # ---- puts ----------------------------------------------------------------

    def place(self, key: bytes, parent: bytes, checksum: bytes, disk_slot: int, data) -> int | None | bool:
        """Where a new page goes before it is indexed: a RAM slot (its bytes copied there), None
        (on disk only: written), or False when it had to be written and the write failed."""
        slot = self.take_ram_slot()
        if slot is not None:
            self._pool[slot] = np.frombuffer(data, dtype=np.uint8)
        if (slot is None or self.write_through) and not self._write(key, parent, checksum, disk_slot, data):
            if slot is not None:
                self._free_slots.append(slot)
            return False
        return slot

    def landed(self, key: bytes, page: Page) -> None:
        """A page placed in RAM and indexed: dirty unless written through."""
        if page.slot is not None and not self.write_through:
            page.dirty = True
            self.dirty[key] = None

    def dropped(self, key: bytes) -> None:
        """The page left the index: it is not written again."""
        self.dirty.pop(key, None)

    def forget(self, key: bytes, page: Page) -> None:
        """The page left the node, and no one reads its slots any more: its disk slot is free (and
        says so on disk)."""
        self.dirty.pop(key, None)
        try:
            self.disk.free(page.disk_slot)
        except OSError as exc:
            self._stats.disk_errors += 1
            log.warning("could not mark disk slot %d of %s free (%s); it is reused all the same",
                        page.disk_slot, self.disk.path, exc)
        self.free_disk_slots.append(page.disk_slot)

    # ---- RAM copies ----------------------------------------------------------

    def take_ram_slot(self) -> int | None:
        """A free RAM slot, dropping the least recently used copy if needed (written first when
        dirty); None when every copy is pinned or dirty with the disk failing. A dirty copy whose
        write fails stays in RAM and a clean one makes room; with none, a put lands on disk
        directly (and a failed write of it refuses the put)."""
        if self._free_slots:
            return self._free_slots.pop()
        kept: list[bytes] = []
        failing = False
        slot = None
        while (victim := self.ram_queue.pop()) is not None:
            page = self._index[victim]
            if page.dirty:
                if failing or not self._write(victim, page.parent, page.checksum, page.disk_slot,
                                              self._pool[page.slot]):
                    failing = True
                    kept.append(victim)
                    continue
                page.dirty = False
                del self.dirty[victim]
            slot, page.slot = page.slot, None
            self._stats.demotions += 1
            break
        for key in kept:
            self.ram_queue.offer(key, self._index[key])
        return slot

    def bytes_of(self, key: bytes, page: Page) -> memoryview | None:
        """The page's bytes, read-only: its RAM slot, promoted there from disk first when it is on
        disk only (into a buffer of its own when no RAM slot can be had); None when the disk lost
        it. Slices of one flat view of the pool, cheaper than a NumPy row and a memoryview a page:
        beside the copy, the store's Python is much of a disk hit's cost (docs/benchmarks.md)."""
        size = self._page_bytes
        if page.slot is not None:
            start = page.slot * size
            return self._flat[start : start + size].toreadonly()
        slot = self.take_ram_slot()
        if slot is not None:
            out = self._flat[slot * size : (slot + 1) * size]
        else:
            out = memoryview(np.empty(size, dtype=np.uint8))
        self._stats.disk_reads += 1
        try:
            intact, error = self.disk.read(page.disk_slot, key, out), None
        except OSError as exc:
            self._stats.disk_errors += 1
            intact, error = False, exc
        if not intact:
            if slot is not None:
                self._free_slots.append(slot)
            if error is None:
                self._lose(key, "failed its check on disk" if self.disk.check == CHECK_ALWAYS
                           else "is not in its slot on disk (its header is short, torn or names another page)", True)
            else:
                self._lose(key, f"could not be read from {self.disk.path} ({error})", False)
            return None
        if slot is not None:
            page.slot = slot  # queued for RAM once unpinned (kvnode/store/pins.py)
            self._stats.promotions += 1
        return out.toreadonly()

    # ---- flushes -------------------------------------------------------------

    def take_dirty(self) -> list[tuple[bytes, Page, int]]:
        """The dirty pages, moved to `flushing`, each with its write sequence number."""
        batch = [(key, self._index[key], self._next_seq()) for key in self.dirty]
        self.flushing.update(self.dirty)
        self.dirty.clear()
        return batch

    def write_batch(self, batch: list[tuple[bytes, Page, int]]) -> int:
        """Write a taken batch (without the store's lock: its pages pinned), then sync; how many
        were written before the first failure (one log line for it); the rest stay dirty in RAM,
        served from there and written again at the next flush."""
        written = 0
        try:
            for key, page, seq in batch:
                self.disk.write(page.disk_slot, key, page.parent, seq, self._pool[page.slot], page.checksum)
                written += 1
            if batch:
                self.disk.sync()
        except OSError as exc:
            self._stats.disk_errors += 1
            left = len(batch) - written
            log.warning("writing pages to %s failed (%s): %d of %d written%s", self.disk.path, exc, written,
                        len(batch), f", the other {left} stay in RAM and are tried again" if left else
                        "; the sync failed, so they may not be on the device")
        return written

    def flushed(self, batch: list[tuple[bytes, Page, int]], written: int) -> None:
        """A batch's writes are over: its first `written` pages are on disk, the rest dirty again."""
        self._stats.disk_writes += written
        for number, (key, page, _) in enumerate(batch):
            self.flushing.discard(key)
            if self._index.get(key) is not page:
                continue  # dropped meanwhile
            if number < written:
                page.dirty = False
            else:
                self.dirty[key] = None

    # ---- internals -----------------------------------------------------------

    def _write(self, key: bytes, parent: bytes, checksum: bytes, disk_slot: int, data) -> bool:
        try:
            self.disk.write(disk_slot, key, parent, self._next_seq(), data, checksum)
        except OSError as exc:
            self._stats.disk_errors += 1
            log.warning("writing page %s to %s failed (%s): it is not on disk", key.hex(), self.disk.path, exc)
            return False
        self._stats.disk_writes += 1
        return True

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def check(self) -> None:
        pages = self._index
        disk = [p.disk_slot for p in pages.values()]
        assert None not in disk, "a page has no disk slot"
        dirty = {k for k, p in pages.items() if p.dirty}
        assert dirty == set(self.dirty) | (self.flushing & pages.keys()), "the dirty list is off"
        assert not set(self.dirty) & self.flushing, "a page is both dirty and being flushed"
        assert all(pages[k].slot is not None for k in dirty), "a dirty page has no RAM copy"
        self.ram_queue.check()
