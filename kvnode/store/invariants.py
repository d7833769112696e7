"""The page store's invariants (kvnode/store/page_store.py), checked by PageStore.check_invariants, which
tests call after every step: the index's child and orphan counts, the leases, the queues, and
the slots of every tier. Read-only; the caller holds the store's lock."""

from __future__ import annotations


def check(store) -> None:
    """AssertionError unless the PageStore `store` is consistent."""
    check_slots(store)
    children: dict[bytes, int] = {}
    orphans: dict[bytes, int] = {}
    for key, page in store._index.items():
        if page.parent in store._index:
            children[page.parent] = children.get(page.parent, 0) + 1
        elif page.parent:
            assert not store.policy.requires_parent, f"page {key.hex()} is cached, its parent not"
            orphans[page.parent] = orphans.get(page.parent, 0) + 1
    for key, page in store._index.items():
        assert page.children == children.get(key, 0), f"page {key.hex()} child count is off"
    assert orphans == store._orphans.by_parent, "orphan counts per missing parent are off"
    num_orphans = store._orphans.num_orphans
    assert num_orphans == sum(orphans.values()), f"orphan count {num_orphans} is off"
    store._leases.check()
    store._queue.check()
    if store._tiers is not None:
        store._tiers.check()


def check_slots(store) -> None:
    """used + free = capacity on every tier (slots of condemned pages are used); no slot both
    free and used, or used twice."""
    condemned = store._drops.condemned
    pages = [*store._index.values(), *condemned.values()]
    assert all(p.pins for p in condemned.values()), "an unpinned dropped page still holds its slots"
    assert not condemned.keys() & store._index.keys(), "a dropped page is in the index"
    ram = [p.slot for p in pages if p.slot is not None]
    tiers = [("RAM", ram, store._free_slots, store.ram_capacity_pages)]
    if store._tiers is None:
        assert len(ram) == len(pages), "a page is not in RAM, and there is no disk tier"
    else:
        tiers.append(("disk", [p.disk_slot for p in pages], store._tiers.free_disk_slots, store.capacity_pages))
    for name, used, free, capacity in tiers:
        assert len(used) + len(free) == capacity, f"{name}: used {len(used)} + free {len(free)} != {capacity}"
        assert len(set(used)) == len(used), f"{name}: two pages share a slot"
        assert not set(used) & set(free), f"{name}: a slot is both free and used"
        assert len(set(free)) == len(free), f"{name}: a slot is free twice"
