"""The page store's vocabulary (kvnode/store/page_store.py): its errors, a put's outcomes, the index's page
record and the counters (the key check and InvalidRequest: kvnode/wire/keys.py). Plain data; no
store logic."""

from __future__ import annotations

import enum
from dataclasses import dataclass

MAX_LEASE_MS = 60_000


class LeaseRefused(Exception):
    """A lookup asked to lease more pages in one call than the node allows; nothing was changed."""


class PageNotFound(KeyError):
    """A requested page is not cached."""

    def __init__(self, key: bytes):
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"page {self.key.hex()} is not cached (evicted or never stored): look it up again"


class PutOutcome(enum.IntEnum):
    """Values match the wire enum kvcache.v1.PutReply.Outcome."""

    STORED = 1
    ALREADY_PRESENT = 2
    REFUSED_NO_PARENT = 3
    REFUSED_NO_ROOM = 4


@dataclass(slots=True)
class _Page:
    slot: int | None  # its RAM slot; None when on disk only
    parent: bytes  # b"" for a root page
    checksum: bytes  # its writer's, sent with it; its readers check it
    tick: int  # last touch
    stored_tick: int
    children: int = 0  # cached pages that name it as parent
    lease_until: float = 0.0
    pins: int = 0  # readers sending straight from its slot (pin_pages)
    disk_slot: int | None = None  # with a disk tier: its slot there (every page has one)
    dirty: bool = False  # in RAM, not yet written to its disk slot


@dataclass
class StoreStats:
    lookups: int = 0
    hit_pages: int = 0
    miss_pages: int = 0
    puts: int = 0
    stored_pages: int = 0
    evictions: int = 0
    refusals: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    get_pages: int = 0
    lease_limited: int = 0  # lookups whose hits the leased-pages bound cut short
    disk_reads: int = 0  # pages read from the disk tier (promotions and served from disk)
    disk_writes: int = 0  # pages written to the disk tier (flushes, demotions, write-through)
    promotions: int = 0  # pages read from disk into RAM
    demotions: int = 0  # RAM copies dropped to make room (the page stays on disk)
    corrupted_dropped: int = 0  # pages whose bytes on disk failed their checksum, at start or read
    orphans_dropped: int = 0  # intact pages dropped because an ancestor was corrupted or lost
    recovered_pages: int = 0  # pages found intact on disk at start
    recovery_seconds: float = 0.0
    disk_errors: int = 0  # reads, writes and syncs of the disk tier that failed (kvnode/store/tiers.py)
    reported_dropped: int = 0  # pages a reader found altered, with their descendants
    reported_kept: int = 0  # pages a reader reported that are intact here (altered on the reader's side)
