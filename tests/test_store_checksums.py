"""The page store keeps each page's writer's checksum (kvnode/wire/checksum.py) beside it, in RAM and
through the disk tier (kept as sent: readers check it, the node does not); a page a reader
reports altered goes with its descendants, also when it is pinned or leased at that moment."""

from __future__ import annotations

import pytest

from kvnode.wire.checksum import first_mismatch, page_checksum
from kvnode.disk.tier import DiskTier
from kvnode.store.page_store import InvalidRequest, PageNotFound, PageStore, PutOutcome
from store_helpers import CheckedStore, key, page

PAGE_BYTES = 64


def chain(store, numbers, parent=b"", altered=()):
    """Pages `numbers`, each the child of the one before; those in `altered` stored with bytes
    that do not match their writer's checksum (as if changed on the node after the put)."""
    for n in numbers:
        data = page(n, PAGE_BYTES)
        checksum = page_checksum(key(n), page(n + 100, PAGE_BYTES) if n in altered else data)
        store.validate_put(key(n), parent, data, checksum)
        assert store.put(key(n), parent, data, checksum) == PutOutcome.STORED
        parent = key(n)


def test_a_page_keeps_the_checksum_its_writer_sent():
    store = CheckedStore(PageStore(8, PAGE_BYTES))
    chain(store, [1, 2])
    assert store.checksums([key(1), key(2)]) == [page_checksum(key(n), page(n, PAGE_BYTES)) for n in (1, 2)]
    with pytest.raises(PageNotFound):
        store.checksums([key(1), key(3)])


def test_a_put_without_a_checksum_gets_one_computed_by_the_node():
    store = CheckedStore(PageStore(8, PAGE_BYTES))
    store.put(key(1), b"", page(1, PAGE_BYTES))
    assert store.checksums([key(1)]) == [page_checksum(key(1), page(1, PAGE_BYTES))]


def test_a_checksum_of_the_wrong_size_is_refused():
    store = PageStore(8, PAGE_BYTES)
    data = page(1, PAGE_BYTES)
    with pytest.raises(InvalidRequest, match="16 bytes"):
        store.validate_put(key(1), b"", data, page_checksum(key(1), data)[:8])


def test_the_key_is_in_the_checksum():
    data = page(1, PAGE_BYTES)
    assert page_checksum(key(1), data) != page_checksum(key(2), data)
    altered = bytearray(data)
    altered[5] ^= 1
    assert page_checksum(key(1), data) != page_checksum(key(1), bytes(altered))


def test_the_checksum_is_carried_to_disk_and_back_after_a_restart(tmp_path):
    store = PageStore(2, PAGE_BYTES, disk=DiskTier(tmp_path, 8, PAGE_BYTES))
    chain(store, [1, 2, 3, 4])  # two of them demoted to disk
    assert store.flush() >= 0
    expected = store.checksums([key(n) for n in (1, 2, 3, 4)])
    store.disk.close()
    again = CheckedStore(PageStore(2, PAGE_BYTES, disk=DiskTier(tmp_path, 8, PAGE_BYTES)))
    assert again.stats.recovered_pages == 4
    assert again.checksums([key(n) for n in (1, 2, 3, 4)]) == expected


def test_a_reported_page_goes_with_its_descendants_and_nothing_else():
    store = CheckedStore(PageStore(8, PAGE_BYTES))
    chain(store, [1, 2, 3], altered={2})
    chain(store, [4], parent=key(1))  # a sibling branch under 1
    assert store.drop_reported(key(2)) == 2
    assert set(store.keys()) == {key(1), key(4)}
    assert store.lookup([key(1), key(2)]) == 1
    assert store.stats.reported_dropped == 2
    assert store.drop_reported(key(2)) == 0  # gone already: nothing to do


def test_a_reported_page_whose_bytes_are_intact_on_the_node_stays():
    """Altered on the reader's side (or a reader that is wrong): the node's copy passes its own check."""
    store = CheckedStore(PageStore(8, PAGE_BYTES))
    chain(store, [1, 2, 3])
    assert store.drop_reported(key(2)) == 0
    assert set(store.keys()) == {key(1), key(2), key(3)}
    assert store.stats.reported_kept == 1 and store.stats.reported_dropped == 0


def test_a_reported_page_on_disk_only_is_checked_there(tmp_path):
    store = PageStore(2, PAGE_BYTES, disk=DiskTier(tmp_path, 8, PAGE_BYTES))
    chain(store, [1, 2, 3, 4], altered={1})  # 1 and 2 demoted to disk
    assert store.drop_reported(key(2)) == 0  # intact where it is
    assert store.drop_reported(key(1)) == 4
    assert not list(store.keys())


def test_a_reported_page_being_sent_leaves_the_index_at_once_and_its_slot_at_its_last_unpin():
    store = CheckedStore(PageStore(8, PAGE_BYTES))
    chain(store, [1, 2, 3], altered={2})
    views = store.pin_pages([key(2)])
    assert store.drop_reported(key(2)) == 2
    assert set(store.keys()) == {key(1)} and store.lookup([key(1), key(2)]) == 1
    assert store.num_free() == 6  # its slot still held by the sender
    del views
    store.unpin_pages([key(2)])
    assert store.num_free() == 7


def test_a_reported_page_that_is_leased_goes_and_the_lease_count_follows():
    store = CheckedStore(PageStore(8, PAGE_BYTES))  # invariants (the leased count among them) after each call
    chain(store, [1, 2, 3], altered={2})
    assert store.lookup([key(1), key(2), key(3)], lease_ms=1000) == 3
    assert store.drop_reported(key(2)) == 2
    assert store.num_leased() == 1


def test_a_page_altered_in_ram_before_its_flush_still_fails_its_checksum_after_a_restart(tmp_path):
    """The disk tier's own checksum covers what was written; the writer's, kept beside it, is what
    tells the reader that what was written was already wrong."""
    store = PageStore(4, PAGE_BYTES, disk=DiskTier(tmp_path, 8, PAGE_BYTES))
    chain(store, [1, 2])
    store._pool[store._index[key(2)].slot, 3] ^= 0x08
    assert store.flush() == 2
    store.disk.close()
    again = CheckedStore(PageStore(4, PAGE_BYTES, disk=DiskTier(tmp_path, 8, PAGE_BYTES)))
    assert again.stats.recovered_pages == 2  # intact as far as the disk can tell
    data = again.read([key(1), key(2)])
    pages = [data[:PAGE_BYTES], data[PAGE_BYTES:]]
    assert first_mismatch([key(1), key(2)], pages, again.checksums([key(1), key(2)])) == 1
