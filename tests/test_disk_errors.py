"""The disk tier when its disk fails (kvnode/store/tiers.py), a flush under way, and a
page dropped while pinned (kvnode/store/drops.py). The slot file is real (tmp_path);
failures come from a DiskTier whose writes or reads raise the OSError a failing disk gives
(EIO, ENOSPC) at the system-call boundary, where os.pwritev and os.preadv would raise it."""

from __future__ import annotations

import errno
import logging
import threading

import grpc
import numpy as np
import pytest

from kvnode.client.data_client import DataPlaneClient
from kvnode.client.data_client_io import DataPlaneError
from kvnode.data_plane.server import DataPlaneServer
from kvnode.disk.tier import CHECK_ALWAYS, SLOTS_FILE, DiskTier
from kvnode.store.page_store import PageNotFound, PageStore, PutOutcome
from store_helpers import CheckedStore, FakeClock, key, page
from test_disk_tier import flip_byte
from test_store_tiers import PAGE_BYTES, in_ram, put_chain


class FailingDisk(DiskTier):
    """A DiskTier whose writes (or reads) raise OSError(`errno`) while `fail_writes` (`fail_reads`) is set."""

    fail_writes: int = 0
    fail_reads: int = 0

    def write(self, slot, key, parent, seq, data, page_checksum):
        if self.fail_writes:
            raise OSError(self.fail_writes, f"{errno.errorcode[self.fail_writes]} writing slot {slot}")
        super().write(slot, key, parent, seq, data, page_checksum)

    def read(self, slot, key, out):
        if self.fail_reads:
            raise OSError(self.fail_reads, f"{errno.errorcode[self.fail_reads]} reading slot {slot}")
        return super().read(slot, key, out)


def failing(tmp_path, ram: int, disk: int, **kwargs) -> CheckedStore:
    store = PageStore(ram, PAGE_BYTES, clock=FakeClock(), disk=FailingDisk(tmp_path, disk, PAGE_BYTES), **kwargs)
    store.check_invariants()
    return CheckedStore(store)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_flush_the_disk_refuses_keeps_its_pages_dirty_and_served_from_ram(tmp_path, caplog):
    store = failing(tmp_path, ram=4, disk=8)
    put_chain(store, [1, 2, 3])
    store.disk.fail_writes = errno.ENOSPC
    assert store.flush() == 0
    assert (store.num_on_disk(), store.num_dirty()) == (0, 3)
    assert len(warnings(caplog)) == 1 and "ENOSPC" in warnings(caplog)[0]
    assert store.read([key(1), key(2), key(3)]) == b"".join(page(n, PAGE_BYTES) for n in (1, 2, 3))
    store.disk.fail_writes = 0
    assert store.flush() == 3 and (store.num_on_disk(), store.num_dirty()) == (3, 0)
    assert store.stats.disk_errors == 1


def test_a_page_that_cannot_be_read_is_a_miss_with_its_descendants_and_the_rest_is_served(tmp_path, caplog):
    store = failing(tmp_path, ram=2, disk=8)
    put_chain(store, [1, 2, 3])
    put_chain(store, [7])  # another chain; 3 and 7 in RAM, 1 and 2 on disk only
    store.disk.fail_reads = errno.EIO
    with pytest.raises(PageNotFound):
        store.read([key(1)])
    assert set(store.keys()) == {key(7)}, "1 and its descendants 2 and 3 are gone"
    assert store.lookup([key(1), key(2)]) == 0
    assert len(warnings(caplog)) == 1 and "could not be read" in warnings(caplog)[0]
    assert (store.stats.disk_errors, store.stats.corrupted_dropped, store.stats.orphans_dropped) == (1, 0, 2)
    assert store.read([key(7)]) == page(7, PAGE_BYTES), "a page in RAM is served still"
    store.disk.fail_reads = 0
    put_chain(store, [1, 2])
    assert store.read([key(1), key(2)]) == page(1, PAGE_BYTES) + page(2, PAGE_BYTES)


def test_a_new_page_the_disk_cannot_take_is_refused_and_nothing_is_held_for_it(tmp_path, caplog):
    store = failing(tmp_path, ram=4, disk=8, write_through=True)
    put_chain(store, [1])
    store.disk.fail_writes = errno.EIO
    assert store.put(key(2), key(1), page(2, PAGE_BYTES)) == PutOutcome.REFUSED_NO_ROOM
    assert key(2) not in store and store.num_free() == 7 and store.num_in_ram() == 1
    assert len(warnings(caplog)) == 1
    store.disk.fail_writes = 0
    put_chain(store, [2], parent=key(1))
    assert store.num_on_disk() == 2


def test_a_dirty_copy_that_cannot_be_written_stays_in_ram_and_a_clean_one_makes_room(tmp_path):
    store = failing(tmp_path, ram=2, disk=8)
    put_chain(store, [1])
    store.flush()  # 1 clean in RAM
    put_chain(store, [2], parent=key(1))  # 2 dirty in RAM
    store.read([key(2)])  # 1 is the least recently used copy
    store.read([key(1)])  # now 2 is
    store.disk.fail_writes = errno.EIO
    put_chain(store, [3], parent=key(2))  # 2 cannot be written: 1, clean, makes room
    assert in_ram(store) == {key(2), key(3)} and store.num_dirty() == 2
    assert store.put(key(4), key(3), page(4, PAGE_BYTES)) == PutOutcome.REFUSED_NO_ROOM, \
        "every copy is dirty and the disk fails: nowhere to put 4"
    assert store.read([key(1), key(2), key(3)]) == b"".join(page(n, PAGE_BYTES) for n in (1, 2, 3))
    store.disk.fail_writes = 0
    assert store.flush() == 2


def test_a_disk_that_fails_reads_costs_a_fetch_over_the_data_plane_not_the_node(tmp_path):
    store = failing(tmp_path, ram=2, disk=8).store
    put_chain(store, [1])
    put_chain(store, [5])
    put_chain(store, [6])  # 1 on disk only, 5 and 6 in RAM
    server = DataPlaneServer(store, "127.0.0.1", 0, timeout_s=5.0).start()
    client = DataPlaneClient("127.0.0.1", server.port)
    try:
        store.disk.fail_reads = errno.EIO
        out = np.empty(PAGE_BYTES, dtype=np.uint8)
        with pytest.raises(DataPlaneError) as refused:
            client.get_into([key(1)], memoryview(out), memoryview(bytearray(16)), timeout_s=5.0)
        assert refused.value.code == grpc.StatusCode.NOT_FOUND
        client.get_into([key(6)], memoryview(out), memoryview(bytearray(16)), timeout_s=5.0)
        assert out.tobytes() == page(6, PAGE_BYTES)
    finally:
        client.close()
        server.stop()


class BlockingDisk(DiskTier):
    """A DiskTier whose first write waits for `go`, having set `writing`."""

    def __init__(self, *args):
        super().__init__(*args)
        self.writing, self.go = threading.Event(), threading.Event()

    def write(self, slot, key, parent, seq, data, page_checksum):
        self.writing.set()
        assert self.go.wait(10), "the test never let the write go on"
        super().write(slot, key, parent, seq, data, page_checksum)


def test_pages_a_flush_is_still_writing_are_not_counted_on_disk(tmp_path):
    store = CheckedStore(PageStore(4, PAGE_BYTES, clock=FakeClock(), disk=BlockingDisk(tmp_path, 8, PAGE_BYTES)))
    put_chain(store, [1, 2, 3])
    flush = threading.Thread(target=store.flush)
    flush.start()
    try:
        assert store.disk.writing.wait(10)
        assert (store.num_on_disk(), store.num_dirty()) == (0, 3), "no page is written yet"
    finally:
        store.disk.go.set()
        flush.join(10)
    assert (store.num_on_disk(), store.num_dirty()) == (3, 0)


def test_a_pinned_page_dropped_with_a_corrupted_ancestor_is_gone_at_once_its_slot_held_until_unpin(tmp_path):
    store = CheckedStore(PageStore(2, PAGE_BYTES, clock=FakeClock(),
                                   disk=DiskTier(tmp_path, 8, PAGE_BYTES, check=CHECK_ALWAYS)))
    put_chain(store, [1, 2, 3, 4])  # 3 and 4 in RAM, 1 and 2 on disk only
    [sending] = store.pin_pages([key(4)])
    flip_byte(tmp_path / SLOTS_FILE, store.store._index[key(2)].disk_slot * store.disk.slot_bytes + 100)
    with pytest.raises(PageNotFound):
        store.read([key(1), key(2)])
    assert key(4) not in store and set(store.keys()) == {key(1)}
    assert (store.stats.corrupted_dropped, store.stats.orphans_dropped) == (1, 2)
    assert store.lookup([key(1), key(2), key(3), key(4)]) == 1
    with pytest.raises(PageNotFound):
        store.pin_pages([key(4)])
    put_chain(store, [2, 3], parent=key(1))
    assert store.put(key(4), key(3), page(4, PAGE_BYTES)) == PutOutcome.REFUSED_NO_ROOM, "4 is still being sent"
    assert bytes(sending) == page(4, PAGE_BYTES), "its slot was not reused while pinned"
    del sending
    store.unpin_pages([key(4)])
    assert store.num_pinned() == 0
    put_chain(store, [4], parent=key(3))
    assert store.read([key(4)]) == page(4, PAGE_BYTES)


def test_leases_on_pages_dropped_with_a_corrupted_ancestor_no_longer_count(tmp_path):
    """Else the leased-pages bound would shrink for good with every such drop. (The disk check
    `always` makes the node find the flipped byte itself; with the default its reader's report
    would drop it through the same path.)"""
    store = CheckedStore(PageStore(1, PAGE_BYTES, clock=FakeClock(),
                                   disk=DiskTier(tmp_path, 8, PAGE_BYTES, check=CHECK_ALWAYS), max_leased_pages=3))
    put_chain(store, [1, 2, 3])
    assert store.lookup([key(1), key(2), key(3)], lease_ms=1000) == 3
    flip_byte(tmp_path / SLOTS_FILE, store.store._index[key(2)].disk_slot * store.disk.slot_bytes + 100)
    with pytest.raises(PageNotFound):
        store.read([key(1), key(2)])
    assert store.num_leased() == 1
    put_chain(store, [5, 6])
    assert store.lookup([key(5), key(6)], lease_ms=1000) == 2, "two more leases fit under the bound of 3"


def test_pages_dropped_while_a_flush_writes_them_are_not_counted_and_stay_dropped_after_a_restart(tmp_path):
    disk = BlockingDisk(tmp_path, 8, PAGE_BYTES, CHECK_ALWAYS)  # the node itself finds the flipped byte
    disk.go.set()
    store = CheckedStore(PageStore(2, PAGE_BYTES, clock=FakeClock(), disk=disk))
    put_chain(store, [1])
    store.flush()
    put_chain(store, [2, 3], parent=key(1))  # 1 clean on disk only, 2 and 3 dirty in RAM
    disk.go.clear()
    disk.writing.clear()
    flush = threading.Thread(target=store.flush)
    flush.start()
    try:
        assert disk.writing.wait(10)
        flip_byte(tmp_path / SLOTS_FILE, store.store._index[key(1)].disk_slot * disk.slot_bytes + 100)
        with pytest.raises(PageNotFound):
            store.read([key(1)])
        assert store.keys() == [] and (store.num_on_disk(), store.num_dirty()) == (0, 0)
    finally:
        disk.go.set()
        flush.join(10)
    assert store.keys() == [] and (store.num_on_disk(), store.num_dirty(), store.num_pinned()) == (0, 0, 0)
    disk.close()
    again = PageStore(2, PAGE_BYTES, disk=DiskTier(tmp_path, 8, PAGE_BYTES))
    assert again.keys() == [] and again.stats.recovered_pages == 0
    again.disk.close()
