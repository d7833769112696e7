"""The orders beside LRU, each on a small store driven by hand: what each keeps that LRU would
not (ARC: pages used twice through a scan; S3-FIFO: pages used while young, and a key
S evicted lately comes back into M; LFU: frequent pages, until aging lets them go). Their
rules (leaf only, leases, pins, the parent) are in test_store_policy_properties.py."""

from __future__ import annotations

from kvnode.eviction import NODE_POLICIES, POLICIES, get_policy
from kvnode.eviction.arc import T1, T2
from kvnode.eviction.s3fifo import MAIN, SMALL
# clock: a FakeClock fixture (conftest)
from store_helpers import STORED, a, b, c, cached, d, e, f, key, make_store, put


def order(store):
    return store.store._queue.order


def test_the_node_may_run_only_the_prefix_safe_policies():
    assert NODE_POLICIES == ["prefix-lru", "prefix-arc", "prefix-s3fifo", "prefix-lfu"]
    assert all(POLICIES[name].prefix_safe for name in NODE_POLICIES)
    assert not any(p.prefix_safe for name, p in POLICIES.items() if name not in NODE_POLICIES)
    assert get_policy("prefix-aware") is POLICIES["prefix-lru"]


def test_arc_keeps_pages_used_twice_through_a_scan_where_lru_loses_them(clock):
    survivors = {}
    for policy in ("prefix-arc", "prefix-lru"):
        store = make_store(4, clock, policy)
        assert [put(store, a), put(store, b)] == [STORED] * 2
        assert store.lookup([a]) == 1 and store.lookup([b]) == 1  # used again: T2 under ARC
        for n in range(6):  # a scan of pages used once
            assert put(store, key(100 + n)) == STORED
        survivors[policy] = cached(store) & {a, b}
    assert survivors == {"prefix-arc": {a, b}, "prefix-lru": set()}


def test_arc_a_child_joining_is_not_a_use(clock):
    store = make_store(4, clock, "prefix-arc")
    assert [put(store, a), put(store, b, a), put(store, c, b)] == [STORED] * 3
    assert {k: order(store)._entries[k].where for k in (a, b, c)} == {a: T1, b: T1, c: T1}
    assert store.lookup([a, b]) == 2
    assert {k: order(store)._entries[k].where for k in (a, b, c)} == {a: T2, b: T2, c: T1}


def test_arc_a_key_in_b1_comes_back_into_t2_and_grows_t1s_target(clock):
    store = make_store(3, clock, "prefix-arc")
    assert put(store, d) == STORED and store.lookup([d]) == 1  # d in T2
    assert [put(store, a), put(store, b), put(store, c)] == [STORED] * 3  # a goes from T1 to B1
    assert a not in store and a in order(store)._ghosts[T1]
    assert put(store, a) == STORED  # b goes to B1
    assert cached(store) == {a, c, d}
    assert order(store)._entries[a].where == T2
    assert order(store).target_t1 == 1.0


def test_s3fifo_moves_a_page_used_while_young_to_main_and_evicts_the_unused(clock):
    store = make_store(5, clock, "prefix-s3fifo")
    assert [put(store, k) for k in (a, b, c, d, e)] == [STORED] * 5
    assert store.lookup([a]) == 1
    assert put(store, f) == STORED
    assert cached(store) == {a, c, d, e, f}  # a, the oldest, was used: it moved to M, b went
    assert order(store)._entries[a].where == MAIN
    assert put(store, b) == STORED  # b's key was in the ghost queue: straight into M
    assert order(store)._entries[b].where == MAIN
    assert order(store)._entries[f].where == SMALL


def test_s3fifo_keeps_a_parent_in_small_until_it_is_a_leaf(clock):
    store = make_store(3, clock, "prefix-s3fifo")
    assert [put(store, a), put(store, b, a), put(store, c)] == [STORED] * 3
    assert put(store, d) == STORED
    assert a in store and b not in store  # a, the oldest, names b: b went first
    assert store.num_orphans() == 0


def test_lfu_keeps_the_frequent_page_then_aging_lets_it_go(clock):
    store = make_store(3, clock, "prefix-lfu")
    assert [put(store, a), put(store, b), put(store, c)] == [STORED] * 3
    for _ in range(3):
        assert store.lookup([a]) == 1
    assert put(store, d) == STORED
    assert cached(store) == {a, c, d}  # b and c had one use, b the older
    store = make_store(2, clock, "prefix-lfu")
    assert put(store, a) == STORED
    for _ in range(3):
        assert store.lookup([a]) == 1  # priority 0 + 4
    rounds = 0
    while a in store:
        rounds += 1
        newcomer = key(200 + rounds)
        assert put(store, newcomer) == STORED
        assert store.lookup([newcomer]) == 1 and store.lookup([newcomer]) == 1  # each used 3 times
        assert rounds < 5, "aging never let the once frequent page go"
    assert rounds == 3  # plain LFU would keep a for ever: each newcomer has 3 uses, a has 4
