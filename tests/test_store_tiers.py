"""The page store over two tiers (RAM and a disk tier under tmp_path), by hand and against a
reference model: RAM makes room by moving its least recently used copy to disk, a page on
disk is served and promoted, the node drops pages only as leaves of what it holds (across
both tiers), every tier keeps used + free = capacity, and a restart finds what was flushed."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.bench import prefix_trace
from kvnode.wire.checksum import page_checksum
from kvnode.disk.tier import CHECK_ALWAYS, CHECK_AT_START, SLOTS_FILE, DiskTier
from kvnode.store.page_store import PageNotFound, PageStore, PutOutcome
from store_helpers import CheckedStore, FakeClock, key, page
from test_disk_tier import flip_byte
from test_store_properties import ReferenceStore

PAGE_BYTES = 64


def tiered(tmp_path, ram: int, disk: int, clock=None, check: str = CHECK_AT_START, **kwargs) -> CheckedStore:
    store = PageStore(ram, PAGE_BYTES, clock=clock or FakeClock(),
                      disk=DiskTier(tmp_path, disk, PAGE_BYTES, check=check), **kwargs)
    store.check_invariants()
    return CheckedStore(store)


def put_chain(store, numbers: list[int], parent: bytes = b"") -> None:
    for n in numbers:
        assert store.put(key(n), parent, page(n, PAGE_BYTES)) == PutOutcome.STORED
        parent = key(n)


def in_ram(store) -> set[bytes]:
    return {k for k, p in store.store._index.items() if p.slot is not None}


def test_a_chain_longer_than_ram_is_served_whole_from_the_two_tiers(tmp_path):
    store = tiered(tmp_path, ram=4, disk=32)
    put_chain(store, list(range(20)))
    assert (store.num_used(), store.num_in_ram(), store.num_free()) == (20, 4, 12)
    assert in_ram(store) == {key(n) for n in range(16, 20)}, "RAM keeps the pages used last"
    assert store.stats.demotions == 16 and store.stats.disk_writes == 16, "each demoted dirty page was written"
    keys = [key(n) for n in range(20)]
    assert store.lookup(keys) == 20
    assert store.read(keys) == b"".join(page(n, PAGE_BYTES) for n in range(20))
    # One read pins its pages as it goes: the first four are promoted (moving 16-19 to disk), the
    # rest come from buffers of their own once every RAM copy is pinned by this read.
    assert (store.stats.promotions, store.stats.disk_reads, store.stats.demotions) == (4, 20, 20)
    assert in_ram(store) == {key(n) for n in range(4)} and store.num_pinned() == 0


def test_a_page_on_disk_is_promoted_and_served_from_a_pinned_view(tmp_path):
    store = tiered(tmp_path, ram=2, disk=8)
    put_chain(store, [1, 2, 3])
    assert key(1) not in in_ram(store)
    views = store.pin_pages([key(1)])
    assert bytes(views[0]) == page(1, PAGE_BYTES) and key(1) in in_ram(store)
    store.unpin_pages([key(1)])


def test_with_every_ram_copy_pinned_a_disk_page_is_served_from_its_own_buffer(tmp_path):
    store = tiered(tmp_path, ram=2, disk=8)
    put_chain(store, [1, 2, 3])  # 2 and 3 in RAM
    store.pin_pages([key(2), key(3)])
    [view] = store.pin_pages([key(1)])
    assert bytes(view) == page(1, PAGE_BYTES) and key(1) not in in_ram(store)
    assert store.put(key(4), key(3), page(4, PAGE_BYTES)) == PutOutcome.STORED, "written straight to disk"
    assert key(4) not in in_ram(store) and not store.store._index[key(4)].dirty
    store.unpin_pages([key(1), key(2), key(3)])
    assert store.read([key(4)]) == page(4, PAGE_BYTES)


def test_the_node_drops_pages_only_as_leaves_of_what_both_tiers_hold(tmp_path):
    store = tiered(tmp_path, ram=2, disk=4)
    put_chain(store, [1, 2, 3])
    put_chain(store, [4])  # a second root; the node is full
    store.lookup([key(1), key(2), key(3)])  # 4 is the least recently used leaf, then 3
    put_chain(store, [5], parent=key(3))
    assert set(store.keys()) == {key(1), key(2), key(3), key(5)}
    assert not in_ram(store) & {key(1), key(2)}, "on disk only, and never dropped: they are not leaves"
    # The node holds one chain 1-2-3-5; its only leaf is the parent the next put names.
    assert store.put(key(6), key(5), page(6, PAGE_BYTES)) == PutOutcome.REFUSED_NO_ROOM
    assert store.stats.evictions == 1


def test_a_page_corrupted_on_disk_is_dropped_with_its_descendants_and_never_served(tmp_path):
    """With the disk check `always` the node itself refuses the page on read."""
    store = tiered(tmp_path, ram=1, disk=8, check=CHECK_ALWAYS)
    put_chain(store, [1, 2, 3, 4])  # 1, 2, 3 on disk, 4 in RAM
    slot = store.store._index[key(2)].disk_slot
    flip_byte(tmp_path / SLOTS_FILE, slot * store.disk.slot_bytes + 100)
    with pytest.raises(PageNotFound):
        store.read([key(1), key(2)])
    assert set(store.keys()) == {key(1)}, "2 and its descendants 3 and 4 are gone"
    assert (store.stats.corrupted_dropped, store.stats.orphans_dropped) == (1, 2)
    assert store.num_pinned() == 0
    assert store.lookup([key(1), key(2)]) == 1


@pytest.mark.parametrize("where", ["on disk only", "promoted"])
def test_checked_at_start_a_page_altered_on_disk_is_served_as_it_is_and_dropped_when_its_reader_reports_it(
        tmp_path, where):
    """The default disk check (kvnode/disk/tier.py: each slot checked whole at start only): the node serves the bytes it finds,
    each with its writer's checksum, which they no longer match; the reader's report (DropPages)
    then finds the node's copy, promoted or read again from disk, altered too, and drops the page
    with its descendants."""
    store = tiered(tmp_path, ram=2, disk=8)
    put_chain(store, [1, 2, 3, 4])  # 1, 2 on disk only; 3, 4 in RAM
    slot = store.store._index[key(2)].disk_slot
    flip_byte(tmp_path / SLOTS_FILE, slot * store.disk.slot_bytes + 100)
    if where == "on disk only":
        store.pin_pages([key(3), key(4)])  # RAM full of pinned copies: 2 is read into a buffer of its own
    served = store.read([key(1), key(2)])[PAGE_BYTES:]
    assert served != page(2, PAGE_BYTES) and page_checksum(key(2), served) != store.checksums([key(2)])[0]
    assert (key(2) in in_ram(store)) is (where == "promoted")
    assert store.drop_reported(key(1)) == 0, "an intact page stays"
    assert store.drop_reported(key(2)) == 3
    assert store.stats.reported_kept == 1
    if where == "on disk only":
        store.unpin_pages([key(3), key(4)])
    assert set(store.keys()) == {key(1)} and store.lookup([key(1), key(2)]) == 1
    assert (store.stats.reported_dropped, store.stats.corrupted_dropped) == (3, 0)
    assert store.num_pinned() == 0


def test_a_page_reported_intact_from_disk_is_promoted_and_its_ram_copy_can_make_room(tmp_path):
    """drop_reported reads a page on disk only into RAM to check it: that copy joins the RAM queue
    (CheckedStore's invariants), so it can be dropped again for the next promotion."""
    store = tiered(tmp_path, ram=2, disk=8)
    put_chain(store, [1, 2, 3, 4])  # 1, 2 on disk only
    assert store.drop_reported(key(1)) == 0 and key(1) in in_ram(store)
    assert store.read([key(2)]) == page(2, PAGE_BYTES)
    assert key(2) in in_ram(store) and store.stats.reported_kept == 1


def reopen(tmp_path, ram: int, disk: int, store=None) -> CheckedStore:
    if store is not None:
        store.disk.close()
    return tiered(tmp_path, ram, disk)


def test_a_restart_finds_every_flushed_page_and_none_that_was_not(tmp_path):
    store = tiered(tmp_path, ram=8, disk=16)
    put_chain(store, [1, 2, 3])
    assert store.flush() == 3 and store.num_dirty() == 0
    put_chain(store, [4], parent=key(3))  # dirty, never flushed: lost in a crash
    again = reopen(tmp_path, 8, 16, store)
    assert set(again.keys()) == {key(1), key(2), key(3)}
    assert again.num_in_ram() == 0 and again.stats.recovered_pages == 3
    assert again.read([key(1), key(2), key(3)]) == b"".join(page(n, PAGE_BYTES) for n in (1, 2, 3))


def test_write_through_puts_every_page_on_disk_before_put_returns(tmp_path):
    store = tiered(tmp_path, ram=8, disk=16, write_through=True)
    put_chain(store, [1, 2])
    assert store.num_dirty() == 0 and store.num_on_disk() == 2
    assert set(reopen(tmp_path, 8, 16, store).keys()) == {key(1), key(2)}


def test_an_evicted_page_does_not_come_back_after_a_restart(tmp_path):
    store = tiered(tmp_path, ram=2, disk=3)
    put_chain(store, [1, 2, 3])
    store.flush()
    put_chain(store, [4])  # evicts 3, the only leaf; 4 is dirty
    assert key(3) not in store
    assert set(reopen(tmp_path, 2, 3, store).keys()) == {key(1), key(2)}


# ---- against a reference model ---------------------------------------------------------

KEYS = [key(n) for n in range(12)]


class ReferenceTiers:
    """The node as ReferenceStore (capacity: the disk's), and which pages have a RAM copy:
    a put or a read of a page on disk only makes room by dropping the RAM copy used least
    recently (ranked before the operation touches anything)."""

    def __init__(self, ram: int, disk: int):
        self.node = ReferenceStore(disk)
        self.ram_capacity = ram
        self.ram: set[bytes] = set()
        self.promotions = self.demotions = 0

    def _make_room(self, order: list[bytes]) -> None:
        if len(self.ram) == self.ram_capacity:
            victim = min(self.ram, key=order.index)
            self.ram.remove(victim)
            self.demotions += 1

    def put(self, k: bytes, parent: bytes, data: bytes, now: float) -> PutOutcome:
        order = list(self.node.lru)
        outcome = self.node.put(k, parent, data, now)
        if outcome == PutOutcome.STORED:
            self.ram &= set(self.node.pages)
            self._make_room(order)
            self.ram.add(k)
        return outcome

    def read(self, k: bytes) -> bytes:
        if k in self.node.pages and k not in self.ram:
            self._make_room(list(self.node.lru))
            self.ram.add(k)
            self.promotions += 1
        return self.node.read(k)


def check_agrees(store: PageStore, model: ReferenceTiers, clock: FakeClock) -> None:
    store.check_invariants()
    assert set(store.keys()) == set(model.node.pages)
    assert {k for k, p in store._index.items() if p.slot is not None} == model.ram
    assert store.num_in_ram() == len(model.ram)
    assert store.num_free() == model.node.capacity - len(model.node.pages)
    assert store.num_leased() == model.node.num_leased(clock.now)
    assert (store.stats.evictions, store.stats.promotions, store.stats.demotions) == (
        model.node.evictions, model.promotions, model.demotions)


def step(draw, store: PageStore, model: ReferenceTiers, clock: FakeClock, number: int) -> None:
    op = draw(st.sampled_from(["put", "put", "put", "lookup", "read", "read", "flush", "advance"]), "op")
    cached = sorted(model.node.pages)
    if op == "put":
        k = draw(st.sampled_from(KEYS), "key")
        parent = draw(st.sampled_from([b""] + cached + KEYS[:2]), "parent")
        if parent == k:
            return
        content = page(number, PAGE_BYTES)
        assert store.put(k, parent, content) == model.put(k, parent, content, clock.now)
    elif op == "lookup":
        keys = model.node.chain(draw(st.sampled_from(cached), "tip")) if cached else []
        lease_ms = draw(st.sampled_from([0, 0, 500]), "lease_ms")
        assert store.lookup(keys, lease_ms) == model.node.lookup(keys, lease_ms, clock.now)
    elif op == "read":
        k = draw(st.sampled_from(KEYS), "key")
        try:
            expected = model.read(k)
        except PageNotFound:
            with pytest.raises(PageNotFound):
                store.read([k])
        else:
            assert store.read([k]) == expected
    elif op == "flush":
        store.flush()
        assert store.num_dirty() == 0
    else:
        clock.advance(draw(st.sampled_from([0.1, 1.0]), "seconds"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data(), ram=st.integers(1, 4), extra=st.integers(0, 6), num_steps=st.integers(1, 40))
def test_two_tiers_agree_with_the_reference_model_and_a_restart_keeps_what_was_flushed(
        tmp_path_factory, data, ram, extra, num_steps):
    folder = tmp_path_factory.mktemp("tiers")
    clock = FakeClock()
    store = PageStore(ram, PAGE_BYTES, clock=clock, disk=DiskTier(folder, ram + extra, PAGE_BYTES))
    model = ReferenceTiers(ram, ram + extra)
    for number in range(num_steps):
        step(lambda strategy, label: data.draw(strategy, label=label), store, model, clock, number)
        check_agrees(store, model, clock)
    store.flush()
    store.disk.close()
    again = PageStore(ram, PAGE_BYTES, clock=clock, disk=DiskTier(folder, ram + extra, PAGE_BYTES))
    again.check_invariants()
    assert set(again.keys()) == set(model.node.pages)
    for k, (_, content) in model.node.pages.items():
        assert again.read([k]) == content
    again.disk.close()


def test_a_working_set_four_times_ram_hits_as_a_ram_of_the_disks_size_would(tmp_path):
    """Replay a chat trace (lookup, fetch the hits, put the rest) on RAM + a disk 4x its size
    and on a RAM-only store of the disk's size: the same hits (the tiers are inclusive), and
    every fetched page's bytes right."""
    trace = prefix_trace.generate(prefix_trace.TraceConfig(requests=300, seed=3, system_prompts=6))
    disk_pages = prefix_trace.working_set_pages(trace) // 2
    stores = {"tiered": PageStore(disk_pages // 4, PAGE_BYTES, disk=DiskTier(tmp_path, disk_pages, PAGE_BYTES)),
              "ram only": PageStore(disk_pages, PAGE_BYTES)}
    hits = {}
    for name, store in stores.items():
        hits[name] = 0
        for request in trace:
            keys = request.keys
            found = store.lookup(keys)
            if found:
                got = np.frombuffer(store.read(keys[:found]), dtype=np.uint8).reshape(found, PAGE_BYTES)
                assert all(row[:16].tobytes() == k[:16] for row, k in zip(got, keys)), name
            hits[name] += found
            parent = keys[found - 1] if found else b""
            for k in keys[found:]:
                store.put(k, parent, k * (PAGE_BYTES // 16))
                parent = k
        store.check_invariants()
    assert hits["tiered"] == hits["ram only"] > 0
    assert stores["tiered"].stats.promotions > 0 and stores["tiered"].stats.demotions > 0
    stores["tiered"].disk.close()
