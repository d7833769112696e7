"""Small helpers for page-store tests: keys, pages, a hand-driven clock, and a store
wrapper that checks the invariants after every call so no test can forget to."""

from __future__ import annotations

import hashlib

from kvnode.store.page_store import PageStore, PutOutcome


def key(n: int) -> bytes:
    """A valid 16-byte page key, distinct for each n."""
    return hashlib.blake2b(n.to_bytes(8, "big", signed=True), digest_size=16).digest()


def page(n: int, page_bytes: int) -> bytes:
    """Page content that differs for each n (so a slot mix-up shows)."""
    return bytes((n * 7 + i) % 256 for i in range(page_bytes))


class FakeClock:
    """A clock that moves only when told to: lease tests never sleep."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class CheckedStore:
    """Forwards to a PageStore and runs check_invariants after every method call (raised or not)."""

    def __init__(self, store: PageStore):
        self.store = store

    def __getattr__(self, name: str):
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            finally:
                self.store.check_invariants()

        return call

    def __contains__(self, key: bytes) -> bool:
        return key in self.store


# ---- the small store the unit tests drive by hand ------------------------------------

PAGE_BYTES = 8
STORED, PRESENT = PutOutcome.STORED, PutOutcome.ALREADY_PRESENT
NO_PARENT, NO_ROOM = PutOutcome.REFUSED_NO_PARENT, PutOutcome.REFUSED_NO_ROOM

a, b, c, d, e, f = (key(n) for n in range(6))


def make_store(capacity: int, clock: FakeClock, policy: str = "prefix-aware") -> CheckedStore:
    store = CheckedStore(PageStore(capacity, PAGE_BYTES, clock=clock, policy=policy))
    store.check_invariants()
    return store


def put(store, k: bytes, parent: bytes = b"") -> PutOutcome:
    """Put key k (content from its first byte) under `parent` (b"" for a root)."""
    return store.put(k, parent, page(k[0], PAGE_BYTES))


def cached(store) -> set[bytes]:
    return set(store.keys())
