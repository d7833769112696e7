"""Random operation sequences on a PageStore under each order beside LRU (ARC, S3-FIFO, LFU),
with the prefix rule and without, against a small reference model of what any policy must
keep.

The model does not know the order (which page goes is the policy's choice); it knows the
rules every choice must keep, and follows the store's choice once it has checked it:
- a page is evicted only when the pool is full and a put needs its slot, one page per put;
- the victim is never leased, never pinned, never the parent the put names;
- under the prefix rule the victim is a leaf, a put whose parent is missing is refused,
  and no page is ever cached without its parent (no orphan);
- a put is refused for want of room exactly when no page may go;
- hits, leases, pins and counters agree, and the store's and the order's own bookkeeping
  holds after every step (check_invariants, which runs the order's check).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvnode.eviction import POLICIES
from kvnode.store.page_store import InvalidRequest, PageNotFound, PageStore, PutOutcome
from store_helpers import FakeClock, key, page

PAGE_BYTES = 4
KEYS = [key(n) for n in range(10)]
NEW_POLICIES = [name for name, policy in POLICIES.items() if policy.order in ("arc", "s3fifo", "lfu")]


class RulesModel:
    """The pages, leases and pins of a store under `policy`, and the rules any victim keeps."""

    def __init__(self, capacity: int, policy: str):
        self.capacity = capacity
        self.prefix_rule = POLICIES[policy].prefix_safe
        self.parents: dict[bytes, bytes] = {}
        self.lease_until: dict[bytes, float] = {}
        self.pins: dict[bytes, int] = {}
        self.evictions = 0

    def is_leaf(self, k: bytes) -> bool:
        return all(parent != k for parent in self.parents.values())

    def may_go(self, k: bytes, parent: bytes, now: float) -> bool:
        return (self.lease_until.get(k, 0.0) <= now and not self.pins.get(k) and k != parent
                and (not self.prefix_rule or self.is_leaf(k)))

    def lookup(self, keys: list[bytes], lease_ms: int, now: float) -> int:
        hits = 0
        for k in keys:
            if k not in self.parents:
                break
            if lease_ms:
                self.lease_until[k] = max(self.lease_until.get(k, 0.0), now + lease_ms / 1000.0)
            hits += 1
        return hits

    def put(self, k: bytes, parent: bytes, now: float, cached_after: set[bytes]) -> PutOutcome:
        """The outcome the rules allow; a victim is taken from `cached_after` (the store's choice), once checked."""
        if parent == k:
            raise InvalidRequest("names itself as its parent")
        if k in self.parents:
            return PutOutcome.ALREADY_PRESENT
        if parent and self.prefix_rule and parent not in self.parents:
            return PutOutcome.REFUSED_NO_PARENT
        if len(self.parents) == self.capacity:
            allowed = {v for v in self.parents if self.may_go(v, parent, now)}
            if not allowed:
                return PutOutcome.REFUSED_NO_ROOM
            gone = set(self.parents) - cached_after
            assert len(gone) == 1, f"a put evicted {len(gone)} pages"
            victim = gone.pop()
            assert victim in allowed, "the store evicted a page the rules protect (leased, pinned, the parent, a non-leaf)"
            del self.parents[victim]
            self.lease_until.pop(victim, None)
            self.evictions += 1
        self.parents[k] = parent
        return PutOutcome.STORED

    def num_orphans(self) -> int:
        return sum(1 for parent in self.parents.values() if parent and parent not in self.parents)

    def num_leased(self, now: float) -> int:
        return sum(1 for k in self.parents if self.lease_until.get(k, 0.0) > now)

    def chain(self, k: bytes) -> list[bytes]:
        out = [k]
        while self.parents.get(out[-1], b"") and len(out) <= len(self.parents):
            out.append(self.parents[out[-1]])
        return [c for c in out[::-1] if c in self.parents]


def do_put(store: PageStore, model: RulesModel, k: bytes, parent: bytes, number: int, now: float) -> None:
    before = set(store.keys())
    try:
        got = store.put(k, parent, page(number, PAGE_BYTES))
    except InvalidRequest:
        got = InvalidRequest
    after = set(store.keys())
    assert before - after <= before, "pages appeared"
    try:
        expected = model.put(k, parent, now, after)
    except InvalidRequest:
        expected = InvalidRequest
    assert got == expected, f"put {k.hex()[:6]} parent {parent.hex()[:6] or 'root'}"


def check_agrees(store: PageStore, model: RulesModel, clock: FakeClock) -> None:
    store.check_invariants()  # counts, slots, children, orphans, leases, and the order's own check
    assert set(store.keys()) == set(model.parents)
    assert store.num_free() == model.capacity - len(model.parents)
    assert store.num_leased() == model.num_leased(clock.now)
    assert store.stats.evictions == model.evictions
    assert store.num_orphans() == model.num_orphans()
    if model.prefix_rule:
        assert store.num_orphans() == 0


def step(data, store: PageStore, model: RulesModel, clock: FakeClock, number: int, pinned: list) -> None:
    op = data.draw(st.sampled_from(["put", "put", "put", "lookup", "lookup", "read", "pin", "unpin", "advance"]))
    cached = sorted(model.parents)
    if op == "put":
        k = data.draw(st.sampled_from(KEYS), label="key")
        kind = data.draw(st.sampled_from(["root", "cached", "any"]) if cached else st.just("root"))
        parent = b"" if kind == "root" else data.draw(st.sampled_from(cached if kind == "cached" else KEYS))
        do_put(store, model, k, parent, number, clock.now)
    elif op == "lookup":
        if cached and data.draw(st.booleans(), label="along a cached chain"):
            keys = model.chain(data.draw(st.sampled_from(cached))) + data.draw(st.lists(st.sampled_from(KEYS), max_size=2))
        else:
            keys = data.draw(st.lists(st.sampled_from(KEYS), max_size=4), label="keys")
        lease_ms = data.draw(st.sampled_from([0, 0, 100, 1000]), label="lease_ms")
        assert store.lookup(keys, lease_ms) == model.lookup(keys, lease_ms, clock.now)
    elif op == "read":
        k = data.draw(st.sampled_from(KEYS), label="key")
        try:
            store.read([k])
            assert k in model.parents
        except PageNotFound:
            assert k not in model.parents
    elif op == "pin" and cached:
        k = data.draw(st.sampled_from(cached), label="pin")
        store.pin_pages([k])
        model.pins[k] = model.pins.get(k, 0) + 1
        pinned.append(k)
    elif op == "unpin" and pinned:
        k = pinned.pop(data.draw(st.integers(0, len(pinned) - 1), label="unpin"))
        store.unpin_pages([k])
        model.pins[k] -= 1
    elif op == "advance":
        clock.advance(data.draw(st.sampled_from([0.05, 0.1, 0.5, 1.0]), label="seconds"))


@pytest.mark.parametrize("policy", NEW_POLICIES)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), capacity=st.integers(1, 6), num_steps=st.integers(1, 50))
def test_every_eviction_keeps_the_rules(policy, data, capacity, num_steps):
    clock = FakeClock()
    store = PageStore(capacity, PAGE_BYTES, clock=clock, policy=policy)
    model = RulesModel(capacity, policy)
    pinned: list[bytes] = []
    for number in range(num_steps):
        step(data, store, model, clock, number, pinned)
        check_agrees(store, model, clock)


@pytest.mark.parametrize("policy", NEW_POLICIES)
@pytest.mark.parametrize("seed", range(2))
def test_long_chain_workloads_keep_the_rules(policy, seed):
    """Longer runs than hypothesis draws, shaped as a worker's: look a chain up, put the rest parents
    first; many evictions, ghost hits, second chances and heap rebuilds; leases and pins between."""
    rng = random.Random(seed)
    clock = FakeClock()
    capacity = 12
    store = PageStore(capacity, PAGE_BYTES, clock=clock, policy=policy)
    model = RulesModel(capacity, policy)
    chains = [[key(100 * n + i) for i in range(rng.randint(1, 6))] for n in range(8)]
    chains += [chains[n % 8][:2] + [key(1000 + 10 * n + i) for i in range(3)] for n in range(8)]  # shared prefixes
    pinned: list[bytes] = []
    for number in range(1500):
        roll = rng.random()
        if roll < 0.7:
            chain = rng.choice(chains)
            lease_ms = rng.choice([0, 0, 0, 200])
            hits = store.lookup(chain, lease_ms)
            assert hits == model.lookup(chain, lease_ms, clock.now)
            for i in range(hits, len(chain)):
                do_put(store, model, chain[i], chain[i - 1] if i else b"", number, clock.now)
        elif roll < 0.8 and model.parents:
            k = rng.choice(sorted(model.parents))
            store.pin_pages([k])
            model.pins[k] = model.pins.get(k, 0) + 1
            pinned.append(k)
        elif roll < 0.9 and pinned:
            k = pinned.pop(rng.randrange(len(pinned)))
            store.unpin_pages([k])
            model.pins[k] -= 1
        else:
            clock.advance(rng.choice([0.05, 0.1, 0.3]))
        check_agrees(store, model, clock)
    assert store.stats.evictions > 100
