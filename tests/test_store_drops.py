"""A page dropped from the store, not evicted (a reader reports it altered, or the disk tier lost
it: kvnode/store/drops.py), leaves the eviction order too (the order is told: removed()),
under every policy: afterwards gets, lookups, puts and evictions work as before, every candidate
heap is rebuilt without tripping on it, no pin is left behind, and the invariants hold after
every call (CheckedStore)."""

from __future__ import annotations

import pytest

from kvnode.wire.checksum import page_checksum
from kvnode.disk.tier import CHECK_ALWAYS, SLOTS_FILE, DiskTier
from kvnode.eviction import NODE_POLICIES, POLICIES
from kvnode.store.page_store import PageNotFound, PageStore, PutOutcome
from store_helpers import CheckedStore, FakeClock, key, page
from test_disk_tier import flip_byte

PAGE_BYTES = 64
# The node's policies first; the others share their orders (kvcache bench eviction runs them).
EVERY_POLICY = NODE_POLICIES + [name for name in POLICIES if name not in NODE_POLICIES]


def put(store, n: int, parent: int | None = None, altered: bool = False) -> None:
    """Page n under page `parent` (a root when None); `altered`: its checksum is not its bytes'."""
    data = page(n, PAGE_BYTES)
    checksum = page_checksum(key(n), page(n + 100, PAGE_BYTES) if altered else data)
    assert store.put(key(n), b"" if parent is None else key(parent), data, checksum) == PutOutcome.STORED


def ordinary_traffic(store, rounds: int = 300, first: int = 1000) -> None:
    """Gets (read and pinned), lookups, puts of roots that each evict a page, and flushes: enough
    for every candidate heap (rebuilt past 2n + 64 entries) to be rebuilt many times over."""
    evictions = store.stats.evictions
    last = key(first - 1)
    assert store.put(last, b"", page(first - 1, PAGE_BYTES)) == PutOutcome.STORED
    for n in range(first, first + rounds):
        assert store.lookup([last]) == 1
        assert store.read([last]) == page(n - 1, PAGE_BYTES)
        views = store.pin_pages([last])
        del views
        store.unpin_pages([last])
        store.flush()
        assert store.put(key(n), b"", page(n, PAGE_BYTES)) == PutOutcome.STORED
        last = key(n)
    assert store.stats.evictions >= evictions + rounds - store.capacity_pages, "the pool was full: puts evicted"
    assert store.num_pinned() == 0


@pytest.mark.parametrize("policy", EVERY_POLICY)
@pytest.mark.parametrize("pinned", [False, True], ids=["unpinned", "being sent"])
def test_after_a_reported_page_goes_with_its_descendants_the_store_works_on(policy, pinned):
    store = CheckedStore(PageStore(8, PAGE_BYTES, clock=FakeClock(), policy=policy))
    put(store, 1)
    put(store, 2, parent=1, altered=True)
    put(store, 3, parent=2)
    put(store, 4, parent=3)
    put(store, 5, parent=1)
    views = store.pin_pages([key(3)]) if pinned else []
    assert store.drop_reported(key(2)) == 3
    assert set(store.keys()) == {key(1), key(5)}
    if pinned:
        del views
        store.unpin_pages([key(3)])
    ordinary_traffic(store)
    assert store.stats.reported_dropped == 3


@pytest.mark.parametrize("policy", EVERY_POLICY)
def test_after_a_page_lost_on_disk_goes_with_its_descendants_the_store_works_on(policy, tmp_path):
    store = CheckedStore(PageStore(2, PAGE_BYTES, clock=FakeClock(), policy=policy,
                                   disk=DiskTier(tmp_path, 8, PAGE_BYTES, check=CHECK_ALWAYS)))
    put(store, 1)
    put(store, 2, parent=1)
    put(store, 3, parent=2)
    put(store, 4)
    put(store, 5)  # 1, 2 and 3 on disk only
    assert store.store._index[key(2)].slot is None
    flip_byte(tmp_path / SLOTS_FILE, store.store._index[key(2)].disk_slot * store.disk.slot_bytes + 100)
    with pytest.raises(PageNotFound):
        store.read([key(1), key(2)])
    assert set(store.keys()) == {key(1), key(4), key(5)}
    assert (store.stats.corrupted_dropped, store.stats.orphans_dropped) == (1, 1)
    ordinary_traffic(store)
