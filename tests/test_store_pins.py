"""Pins (kvnode/store/pins.py): a page whose bytes the data plane is sending from the pool is
never evicted, so its slot is not overwritten mid-send; releasing the last pin makes it
evictable again. Whatever fails partway through a pin, an unpin or a flush, no pin is left
behind (PagePins.pin, PagePins.unpin)."""

from __future__ import annotations

import pytest

from kvnode.disk.tier import DiskTier
from kvnode.eviction import NODE_POLICIES
from kvnode.store.page_store import PageNotFound, PageStore, PutOutcome
from store_helpers import key, page

PAGE_BYTES = 32


def full_store(policy: str = "prefix-aware") -> PageStore:
    store = PageStore(2, PAGE_BYTES, policy=policy)
    assert store.put(key(1), b"", page(1, PAGE_BYTES)) == PutOutcome.STORED
    assert store.put(key(2), b"", page(2, PAGE_BYTES)) == PutOutcome.STORED
    return store


@pytest.mark.parametrize("policy", ["prefix-aware", "lru", "fifo"])
def test_a_pinned_page_is_not_evicted_and_its_bytes_stay(policy):
    store = full_store(policy)
    views = store.pin_pages([key(1), key(2)])
    assert [bytes(v) for v in views] == [page(1, PAGE_BYTES), page(2, PAGE_BYTES)]
    assert store.put(key(3), b"", page(3, PAGE_BYTES)) == PutOutcome.REFUSED_NO_ROOM
    assert [bytes(v) for v in views] == [page(1, PAGE_BYTES), page(2, PAGE_BYTES)]
    store.check_invariants()
    store.unpin_pages([key(1), key(2)])
    assert store.num_pinned() == 0
    assert store.put(key(3), b"", page(3, PAGE_BYTES)) == PutOutcome.STORED
    store.check_invariants()


def test_pins_count_up_and_the_last_unpin_releases():
    store = full_store()
    store.pin_pages([key(1)])
    store.pin_pages([key(1), key(2)])
    store.unpin_pages([key(1), key(2)])
    assert store.num_pinned() == 1
    assert store.put(key(3), b"", page(3, PAGE_BYTES)) == PutOutcome.STORED  # key(2) went
    assert key(1) in store and key(2) not in store
    store.unpin_pages([key(1)])
    store.check_invariants()
    assert store.put(key(4), b"", page(4, PAGE_BYTES)) == PutOutcome.STORED
    store.check_invariants()


def test_pinning_a_missing_page_pins_nothing_and_counts_nothing():
    store = full_store()
    with pytest.raises(PageNotFound) as raised:
        store.pin_pages([key(1), key(9)])
    assert raised.value.key == key(9)
    assert store.num_pinned() == 0 and store.stats.get_pages == 0 and store.stats.bytes_out == 0
    store.check_invariants()


def test_pinned_views_are_read_only_and_count_as_sent():
    store = full_store()
    (view,) = store.pin_pages([key(2)])
    with pytest.raises(TypeError):
        view[0] = 1
    assert store.stats.get_pages == 1 and store.stats.bytes_out == PAGE_BYTES
    store.unpin_pages([key(2)])


def test_a_lease_ending_on_a_pinned_page_does_not_make_it_evictable():
    clock_now = [100.0]
    store = PageStore(2, PAGE_BYTES, clock=lambda: clock_now[0])
    store.put(key(1), b"", page(1, PAGE_BYTES))
    store.put(key(2), b"", page(2, PAGE_BYTES))
    assert store.lookup([key(1)], lease_ms=1000) == 1
    store.pin_pages([key(1)])
    clock_now[0] += 5.0  # the lease ran out; the pin holds
    assert store.put(key(3), b"", page(3, PAGE_BYTES)) == PutOutcome.STORED
    assert key(1) in store and key(2) not in store
    assert store.put(key(4), b"", page(4, PAGE_BYTES)) == PutOutcome.STORED
    assert key(1) in store and key(3) not in store
    store.check_invariants()
    store.unpin_pages([key(1)])
    store.check_invariants()


class Failing(Exception):
    """What an eviction order or a tier raises here: a bug elsewhere, which must not leak pins."""


def failing_for(bad: bytes, method):
    """`method(key, page)`, raising Failing for key `bad`."""

    def call(key_: bytes, page_) -> None:
        if key_ == bad:
            raise Failing(key_.hex())
        method(key_, page_)

    return call


@pytest.mark.parametrize("policy", NODE_POLICIES)
def test_a_pin_that_fails_partway_pins_nothing(policy):
    store = PageStore(4, PAGE_BYTES, policy=policy)
    for n in (1, 2, 3):
        assert store.put(key(n), b"", page(n, PAGE_BYTES)) == PutOutcome.STORED
    touched = store._queue.touched
    store._queue.touched = failing_for(key(2), touched)  # after key(2) is pinned
    with pytest.raises(Failing):
        store.pin_pages([key(1), key(2), key(3)])
    assert store.num_pinned() == 0
    with pytest.raises(Failing):
        store.read([key(1), key(2), key(3)])
    assert store.num_pinned() == 0 and store.stats.get_pages == 0
    store._queue.touched = touched
    store.check_invariants()
    assert store.read([key(2)]) == page(2, PAGE_BYTES)


@pytest.mark.parametrize("policy", NODE_POLICIES)
def test_an_unpin_that_fails_for_one_page_unpins_every_other(policy):
    store = PageStore(4, PAGE_BYTES, policy=policy)
    for n in (1, 2, 3):
        assert store.put(key(n), b"", page(n, PAGE_BYTES)) == PutOutcome.STORED
    store.pin_pages([key(1), key(2), key(3)])
    store._queue.offer = failing_for(key(1), store._queue.offer)
    with pytest.raises(Failing):
        store.unpin_pages([key(1), key(2), key(3)])
    assert store.num_pinned() == 0


def test_a_flush_that_fails_after_its_writes_unpins_its_pages(tmp_path):
    store = PageStore(2, PAGE_BYTES, disk=DiskTier(tmp_path, 8, PAGE_BYTES))
    assert store.put(key(1), b"", page(1, PAGE_BYTES)) == PutOutcome.STORED

    def flushed(batch, written):
        raise Failing("flushed")

    store._tiers.flushed = flushed
    with pytest.raises(Failing):
        store.flush()
    assert store.num_pinned() == 0
