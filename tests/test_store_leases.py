"""Leases under abuse (docs/architecture.md, invariants): the lease heap stays O(live leases) however often
leases are renewed, and no client can lease more than the node's bounds."""

from __future__ import annotations

import pytest

from kvnode.store.page_store import LeaseRefused, PageStore
from store_helpers import PAGE_BYTES, CheckedStore, a, b, c, d, e, key, make_store, put, cached, NO_ROOM, STORED


def chain(store, n: int) -> list[bytes]:
    keys = [key(100 + i) for i in range(n)]
    for i, k in enumerate(keys):
        assert put(store, k, keys[i - 1] if i else b"") == STORED
    return keys


# ---- the lease heap ------------------------------------------------------------------


def test_renewing_leases_in_a_loop_keeps_the_lease_heap_bounded(clock):
    store = PageStore(64, PAGE_BYTES, clock=clock)
    keys = chain(store, 4)
    for n in range(20_000):
        clock.advance(0.001)
        store.lookup(keys, lease_ms=60_000)  # every call renews four long leases
        assert store.lease_heap_size() <= 2 * 4 + 64 + 1, n
    assert store.num_leased() == 4
    store.check_invariants()
    clock.advance(61.0)
    assert store.num_leased() == 0  # the renewed leases still end at their latest expiry
    store.check_invariants()


def test_a_compacted_heap_keeps_every_live_lease(clock):
    """After compactions the leases still protect their pages and still end when they should."""
    store = CheckedStore(PageStore(3, PAGE_BYTES, clock=clock))
    put(store, a)
    put(store, b)
    for _ in range(500):
        clock.advance(0.001)
        store.lookup([a], lease_ms=1000)
    store.lookup([b])
    assert put(store, c) == STORED
    assert put(store, d) == STORED  # b goes: a is leased although least recently used
    assert a in store and b not in store
    clock.advance(1.0)
    assert store.num_leased() == 0
    assert put(store, e) == STORED
    assert a not in store


# ---- bounds ----------------------------------------------------------------------------


def test_a_lookup_asking_to_lease_more_than_the_per_call_bound_is_refused_and_changes_nothing(clock):
    store = CheckedStore(PageStore(8, PAGE_BYTES, clock=clock, max_leases_per_call=2))
    keys = chain(store, 3)
    with pytest.raises(LeaseRefused, match="asked to lease up to 3 pages; this node leases at most 2 per call"):
        store.lookup(keys, lease_ms=1000)
    assert store.num_leased() == 0 and store.stats.lookups == 0
    assert store.lookup(keys) == 3  # without a lease the same call is fine
    assert store.lookup(keys[:2], lease_ms=1000) == 2


def test_leases_stop_at_the_total_bound_and_the_hits_stop_with_them(clock):
    store = CheckedStore(PageStore(8, PAGE_BYTES, clock=clock, max_leased_pages=4))
    keys = chain(store, 6)
    assert store.lookup_and_lease(keys[:3], lease_ms=1000) == (3, False)
    assert store.lookup_and_lease(keys, lease_ms=1000) == (4, True)  # three renewed, one new, then the bound
    assert store.num_leased() == 4 and store.stats.lease_limited == 1
    assert store.lookup(keys) == 6  # a probe without leases sees every page
    clock.advance(1.0)
    assert store.lookup_and_lease(keys[:4], lease_ms=1000) == (4, False)


def test_renewals_are_not_limited_by_the_total_bound(clock):
    """A client holding leases at the bound keeps them alive; only new leases wait for room."""
    store = CheckedStore(PageStore(4, PAGE_BYTES, clock=clock, max_leased_pages=2))
    keys = chain(store, 2)
    assert store.lookup(keys, lease_ms=1000) == 2
    clock.advance(0.9)
    assert store.lookup_and_lease(keys, lease_ms=1000) == (2, False)
    clock.advance(0.9)
    assert store.num_leased() == 2


def test_a_client_leasing_all_it_can_leaves_room_to_evict(clock):
    """One client leases everything it may, in a loop; another client's puts still find room."""
    store = make_store(8, clock)
    bounded = CheckedStore(PageStore(8, PAGE_BYTES, clock=clock, max_leased_pages=4))
    for s in (store, bounded):
        keys = chain(s, 8)
        for _ in range(3):
            s.lookup(keys, lease_ms=60_000)
    assert put(store, key(999)) == NO_ROOM  # unbounded: the greedy client held the whole pool
    for n in range(20):
        assert put(bounded, key(1000 + n)) == STORED
    assert len(cached(bounded)) == 8 and bounded.num_leased() == 4


@pytest.mark.parametrize("kwargs, message", [
    ({"max_leased_pages": 9}, "max_leased_pages must be between 0 and the capacity 8, got 9"),
    ({"max_leased_pages": -1}, "max_leased_pages must be between 0 and the capacity 8, got -1"),
    ({"max_leases_per_call": 0}, "max_leases_per_call must be at least 1, got 0"),
])
def test_bounds_out_of_range_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PageStore(8, PAGE_BYTES, **kwargs)
