"""Random operation sequences on a PageStore against a plain reference model.

The model is the spec written the slow, obvious way: a dict of pages, a list in
least-recently-used order, a dict of lease ends. After every step the store's
invariants hold and everything observable agrees with the model: outcomes, hits,
bytes read, which pages are cached (so which were evicted), leases and counters.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvnode.store.page_store import InvalidRequest, PageNotFound, PageStore, PutOutcome
from store_helpers import FakeClock, key, page

PAGE_BYTES = 4
KEYS = [key(n) for n in range(10)]


class ReferenceStore:
    """Prefix-aware LRU with leases, as docs/architecture.md says, in the plainest code."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.pages: dict[bytes, tuple[bytes, bytes]] = {}  # key -> (parent, data)
        self.lru: list[bytes] = []  # least recently used first
        self.lease_until: dict[bytes, float] = {}
        self.evictions = 0

    def touch(self, k: bytes) -> None:
        self.lru.remove(k)
        self.lru.append(k)

    def is_leaf(self, k: bytes) -> bool:
        return all(parent != k for parent, _ in self.pages.values())

    def is_leased(self, k: bytes, now: float) -> bool:
        return self.lease_until.get(k, 0.0) > now

    def num_leased(self, now: float) -> int:
        return sum(1 for k in self.pages if self.is_leased(k, now))

    def lookup(self, keys: list[bytes], lease_ms: int, now: float) -> int:
        hits = 0
        for k in keys:
            if k not in self.pages:
                break
            self.touch(k)
            if lease_ms:
                self.lease_until[k] = max(self.lease_until.get(k, 0.0), now + lease_ms / 1000.0)
            hits += 1
        return hits

    def read(self, k: bytes) -> bytes:
        if k not in self.pages:
            raise PageNotFound(k)
        self.touch(k)
        return self.pages[k][1]

    def put(self, k: bytes, parent: bytes, data: bytes, now: float) -> PutOutcome:
        if parent == k:
            raise InvalidRequest("names itself as its parent")
        if k in self.pages:
            self.touch(k)
            return PutOutcome.ALREADY_PRESENT
        if parent and parent not in self.pages:
            return PutOutcome.REFUSED_NO_PARENT
        if len(self.pages) == self.capacity:
            victims = [v for v in self.lru if self.is_leaf(v) and not self.is_leased(v, now) and v != parent]
            if not victims:
                return PutOutcome.REFUSED_NO_ROOM
            victim = victims[0]
            del self.pages[victim]
            self.lru.remove(victim)
            self.lease_until.pop(victim, None)
            self.evictions += 1
        self.pages[k] = (parent, data)
        if parent:
            self.touch(parent)  # the store touches a parent when a child joins it
        self.lru.append(k)
        return PutOutcome.STORED

    def chain(self, k: bytes) -> list[bytes]:
        """Keys from the root down to k."""
        out = [k]
        while self.pages[out[-1]][0]:
            out.append(self.pages[out[-1]][0])
        return out[::-1]


def step(data, store: PageStore, model: ReferenceStore, clock: FakeClock, number: int) -> None:
    op = data.draw(st.sampled_from(["put", "put", "put", "lookup", "lookup", "read", "advance"]), label="op")
    cached = sorted(model.pages)
    if op == "put":
        k = data.draw(st.sampled_from(KEYS), label="key")
        parent_kind = data.draw(st.sampled_from(["root", "cached", "any"]) if cached else st.just("root"))
        parent = {
            "root": lambda: b"",
            "cached": lambda: data.draw(st.sampled_from(cached), label="parent"),
            "any": lambda: data.draw(st.sampled_from(KEYS), label="parent"),
        }[parent_kind]()
        content = page(number, PAGE_BYTES)
        expected = _outcome(lambda: model.put(k, parent, content, clock.now))
        got = _outcome(lambda: store.put(k, parent, content))
        assert got == expected, f"put {k.hex()[:6]} parent {parent.hex()[:6]}"
    elif op == "lookup":
        if cached and data.draw(st.booleans(), label="along a cached chain"):
            keys = model.chain(data.draw(st.sampled_from(cached), label="tip"))
            keys += data.draw(st.lists(st.sampled_from(KEYS), max_size=2), label="beyond")
        else:
            keys = data.draw(st.lists(st.sampled_from(KEYS), max_size=4), label="keys")
        lease_ms = data.draw(st.sampled_from([0, 0, 100, 1000]), label="lease_ms")
        assert store.lookup(keys, lease_ms) == model.lookup(keys, lease_ms, clock.now)
    elif op == "read":
        k = data.draw(st.sampled_from(KEYS), label="key")
        assert _outcome(lambda: store.read([k])) == _outcome(lambda: model.read(k))
    else:
        clock.advance(data.draw(st.sampled_from([0.05, 0.1, 0.5, 1.0]), label="seconds"))


def _outcome(call):
    """The result of `call`, or the type of what it raised: both sides must agree on either."""
    try:
        return call()
    except (InvalidRequest, PageNotFound) as exc:
        return type(exc)


def check_agrees(store: PageStore, model: ReferenceStore, clock: FakeClock) -> None:
    store.check_invariants()
    assert set(store.keys()) == set(model.pages)
    assert store.num_used() == len(model.pages)
    assert store.num_free() == model.capacity - len(model.pages)
    assert store.num_leased() == model.num_leased(clock.now)
    assert store.stats.evictions == model.evictions
    store.check_invariants()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), capacity=st.integers(1, 5), num_steps=st.integers(1, 40))
def test_store_agrees_with_the_reference_model(data, capacity, num_steps):
    clock = FakeClock()
    store = PageStore(capacity, PAGE_BYTES, clock=clock)
    model = ReferenceStore(capacity)
    for number in range(num_steps):
        step(data, store, model, clock, number)
        check_agrees(store, model, clock)
    for k in model.pages:  # every page still holds what was put under its key
        assert store.read([k]) == model.read(k)


@pytest.mark.parametrize("seed", range(3))
def test_long_random_runs_agree_with_the_reference_model(seed):
    """Longer sequences than hypothesis draws (many evictions, leases, heap rebuilds)."""
    import random

    rng = random.Random(seed)
    clock = FakeClock()
    capacity = 6
    store = PageStore(capacity, PAGE_BYTES, clock=clock)
    model = ReferenceStore(capacity)
    for number in range(1200):
        roll = rng.random()
        cached = sorted(model.pages)
        if roll < 0.45:
            k = rng.choice(KEYS)
            parent = rng.choice([b""] + cached) if cached else b""
            if parent == k:
                continue
            content = page(number, PAGE_BYTES)
            assert store.put(k, parent, content) == model.put(k, parent, content, clock.now)
        elif roll < 0.85:
            keys = model.chain(rng.choice(cached)) if cached else []
            keys += rng.sample(KEYS, rng.randint(0, 1))
            lease_ms = rng.choice([0, 0, 0, 200])
            assert store.lookup(keys, lease_ms) == model.lookup(keys, lease_ms, clock.now)
        else:
            clock.advance(rng.choice([0.05, 0.1]))
        check_agrees(store, model, clock)
