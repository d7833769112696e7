"""The disk tier's mechanism: one preallocated file of fixed-size slots, a page per slot, each
slot opening with a header that names its page. It knows slots, headers and checksums; which
page goes in which slot, and when, is the store's (kvnode/store/), and rebuilding the index at
start is kvnode/disk/recovery.py's. The tier as a whole: docs/architecture.md, "The disk tier".
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from base.pages import KEY_BYTES

SLOTS_FILE = "pages.slots"
MAGIC = b"KVPG"
VERSION = 2
# magic, version, flags, page bytes, reserved, seq, key, parent, page checksum, slot checksum.
# The page checksum is its writer's (kvnode/wire/checksum.py), kept so a page read back is still
# checked by its reader against what the writer computed; the slot checksum (xxh3-64) covers the
# header's other fields and the page. A zero magic is an empty slot; any other header that does not
# check out is a corrupted or torn slot.
HEADER = struct.Struct(f"<4sHHIIQ{KEY_BYTES}s{KEY_BYTES}s16sQ")
HEADER_BYTES = HEADER.size  # 80
_CHECKED = HEADER_BYTES - 8  # the checksum covers the header up to itself, then the page
_HAS_PARENT = 1
BLOCK_BYTES = 4096  # slots are whole blocks: a torn write damages its own page only
# A slot is checked whole once per process by default: recovery checks every slot at start, and a
# slot this process wrote was checksummed from the bytes it wrote, so a read checks the header only.
# The slot's checksum would be a second pass over the page, about a quarter of a disk hit's CPU
# time. Bytes altered on disk later are caught end to end: every reader checks a page against its
# writer's checksum and reports a mismatch (DropPages), and the node then checks its own copy
# (PageStore.drop_reported). CHECK_ALWAYS checks the slot's checksum on every read as well.
CHECK_AT_START = "start"
CHECK_ALWAYS = "always"
DISK_CHECKS = (CHECK_AT_START, CHECK_ALWAYS)


@dataclass(frozen=True)
class SlotHeader:
    slot: int
    key: bytes
    parent: bytes  # b"" for a root page
    seq: int
    checksum_of_page: bytes  # the writer's (kvnode/wire/checksum.py)
    checksum: int  # of the slot: header and page


class DiskTier:
    """`capacity_pages` slots for pages of `page_bytes` in DIR/pages.slots; not thread-safe (the store locks).
    `check`: when read() checks a slot's checksum (CHECK_AT_START, CHECK_ALWAYS)."""

    def __init__(self, directory: Path | str, capacity_pages: int, page_bytes: int, check: str = CHECK_AT_START):
        if check not in DISK_CHECKS:
            raise ValueError(f"the disk check is one of {', '.join(DISK_CHECKS)}, got {check!r}")
        if capacity_pages < 1:
            raise ValueError(f"the disk tier needs at least one page, got {capacity_pages}")
        if page_bytes < 1:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        self.directory = Path(directory)
        self.capacity_pages = capacity_pages
        self.page_bytes = page_bytes
        self.check = check
        self._check_pages = check == CHECK_ALWAYS
        self.slot_bytes = -(-(HEADER_BYTES + page_bytes) // BLOCK_BYTES) * BLOCK_BYTES
        self.path = self.directory / SLOTS_FILE
        self._head = bytearray(HEADER_BYTES)  # read()'s header, reused: reads run under the store's lock
        # Pages are KV of users' prompts: only the node's user may read them (an older node made 0o644).
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(self._fd).st_mode & 0o077:
                os.fchmod(self._fd, 0o600)
            self._size_file()
        except BaseException:
            os.close(self._fd)
            raise

    def _size_file(self) -> None:
        """Exactly capacity slots: a shorter file (new, or truncated) grows, reserving its blocks so
        the disk cannot fill up mid-run; slots past the capacity (it shrank) are cut off."""
        size = self.capacity_pages * self.slot_bytes
        if os.fstat(self._fd).st_size > size:
            os.ftruncate(self._fd, size)
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            if exc.errno not in (95, 22):  # EOPNOTSUPP, EINVAL: a file system without it; grow sparsely
                raise OSError(exc.errno, f"cannot reserve {size} bytes for {self.path}: {exc.strerror}") from None
            os.ftruncate(self._fd, size)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ---- pages -----------------------------------------------------------------

    def write(self, slot: int, key: bytes, parent: bytes, seq: int, data, page_checksum: bytes) -> None:
        """Write one page and its header into `slot` with one os.pwritev (no copy in Python). In the
        page cache when it returns, so it survives the process's crash (SIGKILL) at once."""
        page = memoryview(data).cast("B")
        assert page.nbytes == self.page_bytes, f"page of {page.nbytes} bytes, slots hold {self.page_bytes}"
        head = self.header(key, parent, page_checksum, seq, page)
        written = os.pwritev(self._fd, [head, page], self._offset(slot))
        if written != HEADER_BYTES + self.page_bytes:
            raise OSError(f"short write to {self.path}: {written} of {HEADER_BYTES + self.page_bytes} bytes")

    def read(self, slot: int, key: bytes, out) -> bool:
        """Read slot's page into `out` (page_bytes, writable); False when the slot does not hold
        `key` (empty, overwritten, a bad header) or, with CHECK_ALWAYS, not intact: then `out`
        holds garbage and must not be served. The hot path of a fetch from disk: one preadv straight
        into `out` (a RAM slot of the pool: a promotion copies once), one unpack, and the slot's
        checksum only with CHECK_ALWAYS."""
        head, size = self._head, self.page_bytes
        assert 0 <= slot < self.capacity_pages, f"slot {slot} outside 0..{self.capacity_pages - 1}"
        if os.preadv(self._fd, [head, out], slot * self.slot_bytes) != HEADER_BYTES + size:
            return False
        magic, version, _, page_bytes, _, _, stored_key, _, _, checksum = HEADER.unpack_from(head)
        return (stored_key == key and magic == MAGIC and version == VERSION and page_bytes == size
                and (not self._check_pages or checksum == self._checksum(head, memoryview(out).cast("B"))))

    def inspect(self, slot: int, head: bytearray, out) -> SlotHeader | None:
        """Read slot's header into `head` and its page into `out`: the header when the page is
        intact, None when the slot is empty or its page is not (is_empty(head) tells which)."""
        view = memoryview(out).cast("B")
        got = os.preadv(self._fd, [head, view], self._offset(slot))
        if got < HEADER_BYTES + self.page_bytes:
            head[got:] = bytes(max(0, HEADER_BYTES - got))
            return None
        header = self.parse_header(slot, head)
        if header is None or header.checksum != self._checksum(head, view):
            return None
        return header

    def free(self, slot: int) -> None:
        """Mark `slot` empty on disk (its magic zeroed), so the file says what the index says: a page
        the store dropped does not come back at the next start."""
        os.pwrite(self._fd, bytes(4), self._offset(slot))

    def sync(self) -> None:
        """fdatasync: the pages written are on the device, surviving the machine's crash too."""
        os.fdatasync(self._fd)

    # ---- headers ---------------------------------------------------------------

    def header(self, key: bytes, parent: bytes, page_checksum: bytes, seq: int, page: memoryview) -> bytes:
        head = HEADER.pack(MAGIC, VERSION, _HAS_PARENT if parent else 0, self.page_bytes, 0, seq, key,
                           parent or bytes(KEY_BYTES), page_checksum, 0)
        return head[:_CHECKED] + self._checksum(head, page).to_bytes(8, "little")

    def parse_header(self, slot: int, raw) -> SlotHeader | None:
        """The header in `raw`, or None when it is not a valid one (empty or corrupted: see is_empty)."""
        magic, version, flags, page_bytes, _, seq, key, parent, page_checksum, checksum = HEADER.unpack_from(raw)
        if magic != MAGIC or version != VERSION or page_bytes != self.page_bytes or flags & ~_HAS_PARENT:
            return None
        if flags & _HAS_PARENT and (parent == key or parent == bytes(KEY_BYTES)):
            return None
        return SlotHeader(slot, key, parent if flags & _HAS_PARENT else b"", seq, page_checksum, checksum)

    @staticmethod
    def is_empty(raw) -> bool:
        return bytes(raw[:4]) == bytes(4)

    @staticmethod
    def is_outdated(raw) -> bool:
        """A slot an older node wrote (version 1: a 64-byte header, no page checksum): not read, its
        page dropped."""
        magic, version = struct.unpack_from("<4sH", raw)
        return magic == MAGIC and version < VERSION

    @staticmethod
    def _checksum(head, page: memoryview) -> int:
        digest = xxhash.xxh3_64(memoryview(head)[:_CHECKED])
        digest.update(page)
        return digest.intdigest()

    def _offset(self, slot: int) -> int:
        assert 0 <= slot < self.capacity_pages, f"slot {slot} outside 0..{self.capacity_pages - 1}"
        return slot * self.slot_bytes
