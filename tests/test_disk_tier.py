"""The disk tier's slot file and the recovery that rebuilds an index from it: real files under
tmp_path. A page written is read back whole; a flipped byte, a torn write or a cut file is
detected; recovery keeps exactly the pages that reach a root through intact pages."""

from __future__ import annotations

import os

import pytest

from kvnode.wire.checksum import page_checksum
from kvnode.disk.tier import BLOCK_BYTES, CHECK_ALWAYS, CHECK_AT_START, DISK_CHECKS, HEADER_BYTES, SLOTS_FILE, DiskTier
from kvnode.disk.recovery import recover
from store_helpers import key, page

PAGE_BYTES = 1000


@pytest.fixture
def tier(tmp_path):
    tier = DiskTier(tmp_path, 8, PAGE_BYTES)
    yield tier
    tier.close()


def write(tier: DiskTier, slot: int, k: bytes, parent: bytes, seq: int, n: int) -> None:
    """Page n (store_helpers.page) under key k, with its writer's checksum."""
    data = page(n, PAGE_BYTES)
    tier.write(slot, k, parent, seq, data, page_checksum(k, data))


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_the_file_is_preallocated_in_block_aligned_slots(tier, tmp_path):
    assert tier.slot_bytes == BLOCK_BYTES and tier.slot_bytes >= HEADER_BYTES + PAGE_BYTES
    assert os.path.getsize(tmp_path / SLOTS_FILE) == 8 * BLOCK_BYTES
    assert os.stat(tmp_path / SLOTS_FILE).st_blocks * 512 >= 8 * BLOCK_BYTES  # blocks reserved, not sparse


def test_only_the_nodes_user_may_read_the_pages_file_and_an_older_open_one_is_closed(tmp_path):
    (tmp_path / "fresh").mkdir()
    DiskTier(tmp_path / "fresh", 2, PAGE_BYTES).close()
    assert os.stat(tmp_path / "fresh" / SLOTS_FILE).st_mode & 0o777 == 0o600
    (tmp_path / "older").mkdir()
    older = tmp_path / "older" / SLOTS_FILE
    older.touch(mode=0o644)
    os.chmod(older, 0o644)  # as a node before this one left it
    DiskTier(tmp_path / "older", 2, PAGE_BYTES).close()
    assert os.stat(older).st_mode & 0o777 == 0o600


def test_a_page_written_is_read_back_whole_and_only_under_its_key(tier):
    write(tier, 3, key(1), key(0), 7, 1)
    out = bytearray(PAGE_BYTES)
    assert tier.read(3, key(1), out) and bytes(out) == page(1, PAGE_BYTES)
    assert not tier.read(3, key(2), out), "another key's page must not be served"
    assert not tier.read(4, key(1), out), "an empty slot holds nothing"


FLIPS = pytest.mark.parametrize("where", [0, 20, 30, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + PAGE_BYTES - 1],
                                ids=["magic", "seq", "key", "checksum", "first data byte", "last data byte"])


def inspected(tier, slot: int):
    """The slot as recovery sees it: its header when intact, else None."""
    return tier.inspect(slot, bytearray(HEADER_BYTES), bytearray(PAGE_BYTES))


@FLIPS
def test_any_flipped_byte_is_detected_by_recovery_and_by_every_read_when_the_check_is_always(tmp_path, where):
    tier = DiskTier(tmp_path, 8, PAGE_BYTES, check=CHECK_ALWAYS)
    write(tier, 2, key(1), b"", 1, 1)
    flip_byte(tmp_path / SLOTS_FILE, 2 * tier.slot_bytes + where)
    assert not tier.read(2, key(1), bytearray(PAGE_BYTES))
    assert inspected(tier, 2) is None
    tier.close()


@FLIPS
def test_checked_at_start_a_read_checks_the_header_and_trusts_the_bytes(tier, tmp_path, where):
    """The once-a-process check (disk/tier.py: CHECK_AT_START): a flipped byte of the header's named
    fields is refused on read; one of the checksum or the page is served (its reader's check of the
    writer's checksum refuses it), and recovery at the next start finds it either way."""
    assert tier.check == CHECK_AT_START
    write(tier, 2, key(1), b"", 1, 1)
    flip_byte(tmp_path / SLOTS_FILE, 2 * tier.slot_bytes + where)
    out = bytearray(PAGE_BYTES)
    named = where in (0, 30)  # the magic, the key: read() checks them (and the version and length)
    assert tier.read(2, key(1), out) is not named
    if not named:
        intact = page_checksum(key(1), out) == page_checksum(key(1), page(1, PAGE_BYTES))
        assert intact is (where < HEADER_BYTES), "the page's own bytes are served as they are on disk"
    assert inspected(tier, 2) is None


@pytest.mark.parametrize("check", DISK_CHECKS)
def test_a_torn_write_is_detected_at_start_and_by_reads_when_the_check_is_always(tmp_path, check):
    """Half of a new page over an old one (a crash mid-write): header and bytes no longer agree."""
    tier = DiskTier(tmp_path, 8, PAGE_BYTES, check=check)
    write(tier, 0, key(1), b"", 1, 1)
    with open(tmp_path / SLOTS_FILE, "r+b") as f:
        f.seek(HEADER_BYTES + PAGE_BYTES // 2)
        f.write(page(9, PAGE_BYTES)[PAGE_BYTES // 2 :])
    assert tier.read(0, key(1), bytearray(PAGE_BYTES)) is (check == CHECK_AT_START)
    assert inspected(tier, 0) is None
    tier.close()


def test_an_unknown_disk_check_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="the disk check is one of start, always, got 'never'"):
        DiskTier(tmp_path, 8, PAGE_BYTES, check="never")


def test_a_freed_slot_reads_as_empty(tier):
    write(tier, 5, key(1), b"", 1, 1)
    tier.free(5)
    head = bytearray(HEADER_BYTES)
    assert tier.inspect(5, head, bytearray(PAGE_BYTES)) is None and DiskTier.is_empty(head)


def chain(tier, first_slot: int, numbers: list[int], parent: bytes = b"") -> None:
    for slot, n in enumerate(numbers, start=first_slot):
        write(tier, slot, key(n), parent, n, n)
        parent = key(n)


def test_recovery_keeps_what_reaches_a_root_parents_first(tier):
    chain(tier, 0, [1, 2, 3])  # 1 <- 2 <- 3
    write(tier, 5, key(4), key(1), 4, 4)  # a second child of 1
    write(tier, 6, key(6), key(99), 6, 6)  # parent never written: dropped
    found = recover(tier)
    assert [h.key for h in found.pages] == [key(1), key(2), key(3), key(4)]
    assert (found.corrupted, found.orphaned) == (0, 1)
    assert sorted(found.free_slots) == [3, 4, 6, 7]
    assert recover(tier).orphaned == 0, "the orphan's slot was emptied on disk"


def test_recovery_drops_a_corrupted_page_with_its_descendants(tier, tmp_path):
    chain(tier, 0, [1, 2, 3, 4])
    flip_byte(tmp_path / SLOTS_FILE, 1 * tier.slot_bytes + HEADER_BYTES + 10)  # page 2's bytes
    found = recover(tier)
    assert [h.key for h in found.pages] == [key(1)]
    assert (found.corrupted, found.orphaned) == (1, 2)
    assert "dropped 1 corrupted or torn pages and 2 pages whose parent was lost" in found.summary(tier)


def test_recovery_after_the_file_was_cut_short(tmp_path):
    tier = DiskTier(tmp_path, 8, PAGE_BYTES)
    chain(tier, 0, [1, 2, 3])
    chain(tier, 3, [4, 5])
    tier.close()
    os.truncate(tmp_path / SLOTS_FILE, 3 * BLOCK_BYTES + HEADER_BYTES + 100)  # page 4 torn, 5 gone
    tier = DiskTier(tmp_path, 8, PAGE_BYTES)
    try:
        assert os.path.getsize(tmp_path / SLOTS_FILE) == 8 * BLOCK_BYTES, "grown back to its capacity"
        found = recover(tier)
        assert [h.key for h in found.pages] == [key(1), key(2), key(3)]
        assert (found.corrupted, found.orphaned) == (1, 0)
    finally:
        tier.close()


def test_a_page_in_two_slots_is_kept_once(tier):
    write(tier, 0, key(1), b"", 1, 1)
    write(tier, 4, key(1), b"", 2, 1)
    found = recover(tier)
    assert [(h.key, h.slot) for h in found.pages] == [(key(1), 4)]
    assert found.duplicates == 1 and 0 in found.free_slots


def test_the_writers_checksum_is_kept_in_the_header_and_older_slots_are_dropped_apart(tier, tmp_path):
    write(tier, 1, key(1), b"", 1, 1)
    head = bytearray(HEADER_BYTES)
    header = tier.inspect(1, head, bytearray(PAGE_BYTES))
    assert header.checksum_of_page == page_checksum(key(1), page(1, PAGE_BYTES))
    write(tier, 2, key(2), b"", 2, 2)
    with open(tmp_path / SLOTS_FILE, "r+b") as f:  # as a node of the first format left it
        f.seek(2 * tier.slot_bytes + 4)
        f.write((1).to_bytes(2, "little"))
    found = recover(tier)
    assert [h.key for h in found.pages] == [key(1)]
    assert (found.outdated, found.corrupted) == (1, 0)
    assert "1 pages an older kvnode wrote without checksums" in found.summary(tier)
