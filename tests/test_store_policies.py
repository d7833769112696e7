"""PageStore under each eviction policy: prefix-lru (the node's default), plain lru and fifo;
the others' orders in test_store_orders.py.

Every store here is a CheckedStore: the invariants are checked after every call. The
last tests run random operations against a plain reference model of lru and fifo.
"""

from __future__ import annotations

import random

import pytest

from kvnode.eviction import POLICIES
from kvnode.store.page_store import PageStore, PutOutcome
# clock: a FakeClock fixture (conftest)
from store_helpers import (NO_PARENT, NO_ROOM, PAGE_BYTES, PRESENT, STORED, FakeClock, a, b, c, cached, d, e, key,
                           make_store, page, put)

ALL_POLICIES = list(POLICIES)


def test_default_policy_is_prefix_lru_also_under_its_old_name():
    assert PageStore(2, PAGE_BYTES).policy.name == "prefix-lru"
    assert PageStore(2, PAGE_BYTES, policy="prefix-aware").policy.name == "prefix-lru"


def test_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'.*prefix-lru, prefix-arc, .*, lru, fifo"):
        PageStore(2, PAGE_BYTES, policy="mru")


# ---- eviction order ----------------------------------------------------------------


def test_lru_evicts_the_least_recently_touched_page_even_with_children(clock):
    store = make_store(3, clock, "lru")
    assert [put(store, a), put(store, b, a), put(store, c)] == [STORED] * 3
    assert store.lookup([c]) == 1  # order now: a (touched when b joined), b, c
    assert put(store, d) == STORED
    assert cached(store) == {b, c, d}  # a went although b names it: prefix-aware would keep it
    assert store.lookup([a, b]) == 0 and b in store  # b is cached but no lookup from the root reaches it
    assert store.num_orphans() == 1
    assert store.lookup([c]) == 1  # touch c: b is now the oldest
    assert put(store, e) == STORED
    assert cached(store) == {c, d, e}
    assert store.num_orphans() == 0  # the orphan itself was evicted


def test_fifo_evicts_the_oldest_stored_page_whatever_was_touched(clock):
    store = make_store(3, clock, "fifo")
    assert [put(store, a), put(store, b, a), put(store, c, b)] == [STORED] * 3
    assert store.lookup([a, b, c]) == 3
    assert put(store, a) == PRESENT  # touching changes nothing under fifo
    assert put(store, d) == STORED
    assert cached(store) == {b, c, d}
    assert store.num_orphans() == 1  # b's parent a is gone
    assert put(store, e) == STORED
    assert cached(store) == {c, d, e}
    assert store.num_orphans() == 1  # now c's parent b is gone


def test_prefix_aware_evicts_leaves_only(clock):
    store = make_store(3, clock, "prefix-aware")
    assert [put(store, a), put(store, b, a), put(store, c)] == [STORED] * 3
    assert store.lookup([c]) == 1
    assert put(store, d) == STORED
    assert cached(store) == {a, c, d}  # b, the least recently used leaf; a is its parent, not a leaf


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_a_put_never_evicts_the_parent_it_names(clock, policy):
    store = make_store(2, clock, policy)
    assert [put(store, a), put(store, b)] == [STORED] * 2
    assert store.lookup([b]) == 1  # a is first to go under both policies
    assert put(store, c, a) == STORED
    assert cached(store) == {a, c}
    assert store.lookup([a, c]) == 2


# ---- puts with a missing parent and orphans ----------------------------------------


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_lru_and_fifo_accept_a_put_whose_parent_is_missing(clock, policy):
    store = make_store(4, clock, policy)
    assert put(store, b, a) == STORED
    assert put(store, c, b) == STORED
    assert store.num_orphans() == 1  # b; c's parent b is cached
    assert store.lookup([a, b, c]) == 0
    assert store.stats.refusals == 0


def test_prefix_aware_refuses_a_put_whose_parent_is_missing(clock):
    store = make_store(4, clock, "prefix-aware")
    assert put(store, b, a) == NO_PARENT
    assert cached(store) == set() and store.num_orphans() == 0
    assert store.stats.refusals == 1


@pytest.mark.parametrize("policy, survivors", [("lru", {b, c}), ("fifo", {c, d})])
def test_a_parent_stored_again_adopts_its_orphans(clock, policy, survivors):
    store = make_store(3, clock, policy)
    assert [put(store, a), put(store, b, a), put(store, c, a)] == [STORED] * 3
    assert store.lookup([b, c]) == 2
    assert put(store, d) == STORED  # a is first to go under both policies
    assert a not in store and store.num_orphans() == 2  # b and c
    assert store.lookup([a, b]) == 0
    assert store.lookup([b, c]) == 2  # lru: d goes next; fifo: b still does
    assert put(store, a) == STORED
    assert cached(store) == survivors | {a}
    assert store.num_orphans() == 0
    for child in survivors & {b, c}:
        assert store.lookup([a, child]) == 2


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_orphans_appear_without_the_prefix_rule_but_never_with_it(clock, policy):
    """The same chain-shaped workload as the worker's (lookup, then put the missing pages
    parents first) on a pool smaller than the working set."""
    rng = random.Random(7)
    store = make_store(12, clock, policy)
    chains = [[key(100 * n + i) for i in range(rng.randint(2, 8))] for n in range(10)]
    peak = 0
    for _ in range(300):
        chain = rng.choice(chains)
        hits = store.lookup(chain)
        for i in range(hits, len(chain)):
            put(store, chain[i], chain[i - 1] if i else b"")
        peak = max(peak, store.num_orphans())
    assert store.stats.evictions > 0
    if POLICIES[policy].leaves_only:
        assert peak == 0
    else:
        assert peak > 0


# ---- leases --------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_a_leased_page_is_never_evicted(clock, policy):
    store = make_store(2, clock, policy)
    assert [put(store, a), put(store, b)] == [STORED] * 2
    assert store.lookup([a], lease_ms=1000) == 1  # a would go first under fifo
    assert store.lookup([b]) == 1  # ... and now under lru and prefix-aware too, but for its lease
    assert store.lookup([a], lease_ms=1000) == 1
    assert put(store, c) == STORED
    assert cached(store) == {a, c}
    assert store.lookup([c], lease_ms=1000) == 1
    assert put(store, d) == NO_ROOM  # both leased: refused, nothing broken
    assert cached(store) == {a, c}
    clock.advance(1.5)  # the leases end
    assert store.num_leased() == 0
    assert put(store, d) == STORED
    assert len(cached(store) & {a, c}) == 1


# ---- against a reference model --------------------------------------------------------


class ReferencePlainStore:
    """lru or fifo with leases, in the plainest code: a list in eviction order."""

    def __init__(self, capacity: int, policy: str):
        self.capacity = capacity
        self.by_last_touch = policy == "lru"
        self.parents: dict[bytes, bytes] = {}
        self.order: list[bytes] = []  # first to go first
        self.lease_until: dict[bytes, float] = {}
        self.evictions = 0

    def touch(self, k: bytes) -> None:
        if self.by_last_touch:
            self.order.remove(k)
            self.order.append(k)

    def lookup(self, keys: list[bytes], lease_ms: int, now: float) -> int:
        hits = 0
        for k in keys:
            if k not in self.parents:
                break
            self.touch(k)
            if lease_ms:
                self.lease_until[k] = max(self.lease_until.get(k, 0.0), now + lease_ms / 1000.0)
            hits += 1
        return hits

    def put(self, k: bytes, parent: bytes, now: float) -> PutOutcome:
        if k in self.parents:
            self.touch(k)
            return PutOutcome.ALREADY_PRESENT
        if len(self.parents) == self.capacity:
            victims = [v for v in self.order if self.lease_until.get(v, 0.0) <= now and v != parent]
            if not victims:
                return PutOutcome.REFUSED_NO_ROOM
            del self.parents[victims[0]]
            self.order.remove(victims[0])
            self.lease_until.pop(victims[0], None)
            self.evictions += 1
        if parent in self.parents:
            self.touch(parent)
        self.parents[k] = parent
        self.order.append(k)
        return PutOutcome.STORED

    def num_orphans(self) -> int:
        return sum(1 for parent in self.parents.values() if parent and parent not in self.parents)

    def num_leased(self, now: float) -> int:
        return sum(1 for k in self.parents if self.lease_until.get(k, 0.0) > now)


@pytest.mark.parametrize("policy", ["lru", "fifo"])
@pytest.mark.parametrize("seed", range(3))
def test_random_runs_agree_with_the_reference_model(policy, seed):
    rng = random.Random(seed)
    clock = FakeClock()
    capacity = 6
    keys = [key(n) for n in range(12)]
    store = PageStore(capacity, PAGE_BYTES, clock=clock, policy=policy)
    model = ReferencePlainStore(capacity, policy)
    seen_orphans = 0
    for number in range(2000):
        roll = rng.random()
        if roll < 0.5:
            k = rng.choice(keys)
            parent = rng.choice([b""] + keys)
            if parent == k:
                continue
            assert store.put(k, parent, page(number, PAGE_BYTES)) == model.put(k, parent, clock.now)
        elif roll < 0.9:
            chain = rng.sample(keys, rng.randint(1, 4))
            lease_ms = rng.choice([0, 0, 0, 200])
            assert store.lookup(chain, lease_ms) == model.lookup(chain, lease_ms, clock.now)
        else:
            clock.advance(rng.choice([0.05, 0.1]))
        store.check_invariants()
        assert set(store.keys()) == set(model.parents)
        assert store.num_orphans() == model.num_orphans()
        assert store.num_leased() == model.num_leased(clock.now)
        assert store.stats.evictions == model.evictions
        seen_orphans = max(seen_orphans, store.num_orphans())
    assert seen_orphans > 0  # the run did exercise orphans
