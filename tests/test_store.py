"""PageStore: pool, free list, index, prefix-aware LRU eviction, leases (docs/architecture.md, invariants).

Every store here is a CheckedStore: the invariants are checked after every call.
"""

from __future__ import annotations

import pytest

from kvnode.store.page_store import MAX_LEASE_MS, InvalidRequest, PageNotFound, PageStore
# clock: a FakeClock fixture (conftest)
from store_helpers import NO_PARENT, NO_ROOM, PAGE_BYTES, PRESENT, STORED, a, b, c, cached, d, e, f, make_store, page, put


# ---- pool, free list, index --------------------------------------------------------


def test_new_store_is_all_free(clock):
    store = make_store(5, clock)
    assert (store.num_used(), store.num_free(), store.num_leased()) == (0, 5, 0)
    assert store.keys() == []


@pytest.mark.parametrize("capacity, page_bytes", [(0, 8), (-1, 8), (4, 0)])
def test_store_rejects_an_empty_pool(capacity, page_bytes):
    with pytest.raises(ValueError):
        PageStore(capacity, page_bytes)


def test_put_then_lookup_and_read_give_the_same_bytes(clock):
    store = make_store(4, clock)
    assert store.put(a, b"", page(1, PAGE_BYTES)) == STORED
    assert store.put(b, a, page(2, PAGE_BYTES)) == STORED
    assert (store.num_used(), store.num_free()) == (2, 2)
    assert store.lookup([a, b]) == 2
    assert store.read([a]) == page(1, PAGE_BYTES)
    assert store.read([b]) == page(2, PAGE_BYTES)
    assert store.read([b], prefix=b"hdr") == b"hdr" + page(2, PAGE_BYTES)
    assert store.read([b, a], prefix=b"hdr") == b"hdr" + page(2, PAGE_BYTES) + page(1, PAGE_BYTES)


def test_put_accepts_any_bytes_like_page(clock):
    import numpy as np

    store = make_store(2, clock)
    data = np.arange(PAGE_BYTES, dtype=np.uint8)
    assert store.put(a, b"", memoryview(data)) == STORED
    assert store.read([a]) == data.tobytes()


def test_free_list_fills_to_capacity_then_slots_are_reused(clock):
    store = make_store(3, clock)
    for n, k in enumerate([a, b, c]):
        assert put(store, k) == STORED
        assert (store.num_used(), store.num_free()) == (n + 1, 2 - n)
    for k in [d, e, f]:  # each needs an eviction; used stays at capacity
        assert put(store, k) == STORED
        assert (store.num_used(), store.num_free()) == (3, 0)
    assert store.stats.evictions == 3
    for k in [d, e, f]:  # reused slots hold the new pages, not the evicted ones
        assert store.read([k]) == page(k[0], PAGE_BYTES)


def test_lookup_answers_the_longest_cached_prefix(clock):
    store = make_store(4, clock)
    put(store, a)
    put(store, b, a)
    put(store, c, b)
    assert store.lookup([a, b, c]) == 3
    assert store.lookup([a, b, d, c]) == 2  # stops at the first miss, even if later keys are cached
    assert store.lookup([d, a]) == 0
    assert store.lookup([]) == 0
    assert (store.stats.lookups, store.stats.hit_pages, store.stats.miss_pages) == (4, 5, 4)


def test_read_of_a_missing_page_names_it(clock):
    store = make_store(2, clock)
    with pytest.raises(PageNotFound) as raised:
        store.read([a])
    assert a.hex() in str(raised.value)
    put(store, a)
    store.check_cached([a])
    with pytest.raises(PageNotFound) as raised:
        store.check_cached([a, b])
    assert raised.value.key == b


# ---- refusals and bad input ---------------------------------------------------------


def test_put_of_a_page_whose_parent_is_not_cached_is_refused(clock):
    store = make_store(4, clock)
    assert put(store, b, a) == NO_PARENT
    assert cached(store) == set()
    assert store.stats.refusals == 1
    assert store.stats.stored_pages == 0


@pytest.mark.parametrize(
    "k, parent, size, message",
    [
        (a[:15], b"", PAGE_BYTES, "key must be 16 bytes, got 15"),
        (a + b"x", b"", PAGE_BYTES, "key must be 16 bytes, got 17"),
        (b"", b"", PAGE_BYTES, "key must be 16 bytes, got 0"),
        (b, a[:4], PAGE_BYTES, "parent key must be 16 bytes, got 4"),
        (a, a, PAGE_BYTES, "names itself as its parent"),
        (b, b"", PAGE_BYTES - 1, f"has {PAGE_BYTES - 1} bytes"),
        (b, b"", PAGE_BYTES + 1, f"has {PAGE_BYTES + 1} bytes"),
        (b, b"", 0, "has 0 bytes"),
    ],
)
def test_bad_put_is_refused_and_changes_nothing(clock, k, parent, size, message):
    store = make_store(2, clock)
    put(store, a)
    before = (cached(store), store.num_free(), store.stats.puts)
    with pytest.raises(InvalidRequest, match=message):
        store.put(k, parent, bytes(size))
    assert (cached(store), store.num_free(), store.stats.puts) == before


@pytest.mark.parametrize("bad", [b"", a[:15], a + b"\0"])
def test_lookup_of_a_key_of_the_wrong_length_is_refused(clock, bad):
    store = make_store(2, clock)
    put(store, a)
    with pytest.raises(InvalidRequest, match=f"got {len(bad)}"):
        store.lookup([a, bad])
    assert store.stats.lookups == 0


# ---- prefix-aware LRU eviction ------------------------------------------------------


def test_least_recently_used_leaf_is_evicted_first(clock):
    store = make_store(3, clock)
    for k in [a, b, c]:
        put(store, k)
    put(store, d)
    assert cached(store) == {b, c, d}  # a was oldest
    put(store, e)
    assert cached(store) == {c, d, e}


def test_only_leaves_are_evicted_and_evicting_a_leaf_makes_its_parent_one(clock):
    store = make_store(3, clock)
    put(store, a)
    put(store, b, a)  # a is now the oldest page, but not a leaf
    put(store, c)
    put(store, d)
    assert cached(store) == {a, c, d}  # b went, not a
    put(store, e)  # a is a leaf again, and the least recently used
    assert cached(store) == {c, d, e}


def test_a_chain_is_evicted_from_its_tip(clock):
    store = make_store(3, clock)
    put(store, a)
    put(store, b, a)
    put(store, c, b)
    put(store, d)
    assert cached(store) == {a, b, d}
    put(store, e)
    assert cached(store) == {a, d, e}
    put(store, f)
    assert cached(store) == {d, e, f}


def test_the_parent_of_the_page_being_put_is_never_evicted_for_it(clock):
    store = make_store(2, clock)
    put(store, a)
    put(store, b)
    store.lookup([b])  # a is the least recently used leaf
    assert put(store, c, a) == STORED
    assert cached(store) == {a, c}


def test_a_put_whose_only_evictable_page_is_its_parent_is_refused(clock):
    store = make_store(1, clock)
    put(store, a)
    assert put(store, b, a) == NO_ROOM
    assert cached(store) == {a}
    assert store.stats.refusals == 1


@pytest.mark.parametrize(
    "touch",
    [
        lambda s: s.lookup([a]),
        lambda s: s.read([a]),
        lambda s: s.put(a, b"", page(99, PAGE_BYTES)),  # put of a present page only touches it
    ],
    ids=["lookup", "read", "put-of-present"],
)
def test_lookup_read_and_put_of_a_present_page_touch_it(clock, touch):
    store = make_store(2, clock)
    put(store, a)
    put(store, b)
    touch(store)
    put(store, c)
    assert cached(store) == {a, c}


def test_put_of_a_present_page_keeps_its_content(clock):
    store = make_store(2, clock)
    put(store, a)
    assert store.put(a, b"", page(99, PAGE_BYTES)) == PRESENT
    assert store.read([a]) == page(a[0], PAGE_BYTES)
    assert store.stats.stored_pages == 1


def test_lookup_touches_every_hit_of_the_chain(clock):
    store = make_store(3, clock)
    put(store, a)
    put(store, b, a)
    put(store, c)  # leaves: b (older), c
    store.lookup([a, b, d])
    put(store, e)
    assert cached(store) == {a, b, e}


def test_many_touches_keep_the_order_right(clock):
    """Thousands of touches on a tiny store (the leaf heap gets rebuilt on the way)."""
    store = PageStore(3, PAGE_BYTES, clock=clock)
    for k in [a, b, c]:
        put(store, k)
    for n in range(3000):
        store.lookup([[a, c][n % 2]])
    store.check_invariants()
    put(store, d)
    assert cached(store) == {a, c, d}
    store.check_invariants()


# ---- leases -------------------------------------------------------------------------


def test_a_lookup_with_a_lease_leases_its_hits_only(clock):
    store = make_store(4, clock)
    put(store, a)
    put(store, b, a)
    assert store.lookup([a, b, c], lease_ms=500) == 2
    assert store.num_leased() == 2
    assert store.lookup([a], lease_ms=0) == 1
    assert store.num_leased() == 2


def test_a_leased_page_is_not_evicted_and_its_lease_frees_itself(clock):
    store = make_store(2, clock)
    put(store, a)
    put(store, b)
    store.lookup([a], lease_ms=1000)
    store.lookup([b])  # a is the least recently used leaf, but leased
    put(store, c)
    assert cached(store) == {a, c}
    clock.advance(0.999)
    assert store.num_leased() == 1
    clock.advance(0.001)
    assert store.num_leased() == 0  # expired with no call to release it
    put(store, d)
    assert cached(store) == {c, d}  # a, now unleased and least recently used, went


def test_a_lookup_without_lease_renews_nothing(clock):
    store = make_store(2, clock)
    put(store, a)
    put(store, b)
    store.lookup([a], lease_ms=1000)
    clock.advance(0.6)
    store.lookup([a], lease_ms=0)
    clock.advance(0.6)
    assert store.num_leased() == 0


def test_a_longer_lease_extends_and_a_shorter_one_does_not_shorten(clock):
    store = make_store(2, clock)
    put(store, a)
    store.lookup([a], lease_ms=1000)
    clock.advance(0.5)
    store.lookup([a], lease_ms=1000)  # now until 1.5 s
    store.lookup([a], lease_ms=10)
    clock.advance(0.9)
    assert store.num_leased() == 1
    clock.advance(0.1)
    assert store.num_leased() == 0


@pytest.mark.parametrize("lease_ms", [MAX_LEASE_MS + 1, -1, 10**9])
def test_a_lease_out_of_range_is_refused_and_changes_nothing(clock, lease_ms):
    store = make_store(2, clock)
    put(store, a)
    put(store, b)
    with pytest.raises(InvalidRequest, match=f"lease_ms must be between 0 and {MAX_LEASE_MS}"):
        store.lookup([a], lease_ms=lease_ms)
    assert store.num_leased() == 0
    assert store.stats.lookups == 0
    put(store, c)
    assert cached(store) == {b, c}  # a was not touched either


def test_the_longest_lease_is_accepted(clock):
    store = make_store(1, clock)
    put(store, a)
    assert store.lookup([a], lease_ms=MAX_LEASE_MS) == 1
    clock.advance(MAX_LEASE_MS / 1000 - 0.001)
    assert store.num_leased() == 1


def test_when_every_evictable_page_is_leased_a_put_is_refused_and_no_lease_broken(clock):
    store = make_store(2, clock)
    put(store, a)
    put(store, b)
    store.lookup([a], lease_ms=1000)
    store.lookup([b], lease_ms=1000)
    assert put(store, c) == NO_ROOM
    assert put(store, d, a) == NO_ROOM
    assert cached(store) == {a, b}
    assert store.num_leased() == 2
    assert store.read([a]) == page(a[0], PAGE_BYTES)
    assert (store.stats.refusals, store.stats.evictions) == (2, 0)
    clock.advance(1.0)
    assert put(store, c) == STORED
    assert store.stats.evictions == 1


def test_a_leased_parent_that_becomes_a_leaf_is_still_protected(clock):
    store = make_store(2, clock)
    put(store, a)
    put(store, b, a)
    store.lookup([a], lease_ms=1000)  # a leased, b not
    assert put(store, c) == STORED  # b evicted: a becomes a leaf, still leased
    assert cached(store) == {a, c}
    store.lookup([c], lease_ms=1000)
    assert put(store, d) == NO_ROOM
    clock.advance(1.0)
    assert put(store, d) == STORED
    assert cached(store) == {c, d}  # a (least recently used) went once its lease ended


def test_a_lease_survives_a_failed_eviction_pass_and_is_evictable_after(clock):
    """A leased leaf passed over by an eviction comes back as evictable when the lease ends."""
    store = make_store(1, clock)
    put(store, a)
    store.lookup([a], lease_ms=100)
    assert put(store, b) == NO_ROOM
    clock.advance(0.1)
    assert put(store, b) == STORED
    assert cached(store) == {b}


# ---- counters -----------------------------------------------------------------------


def test_counters_move_as_operations_happen(clock):
    store = make_store(2, clock)
    put(store, a)
    put(store, b, a)
    put(store, a)
    put(store, d, c)
    store.lookup([a, b, c])
    store.read([a])
    put(store, e)
    s = store.stats
    assert (s.puts, s.stored_pages, s.refusals, s.evictions) == (5, 3, 1, 1)
    assert (s.lookups, s.hit_pages, s.miss_pages) == (1, 2, 1)
    assert (s.get_pages, s.bytes_out) == (1, PAGE_BYTES)
    assert s.bytes_in == 3 * PAGE_BYTES  # stored pages only: not the one already present, not the refused one
