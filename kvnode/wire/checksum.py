"""The page checksum: xxh3-128 of the page's key followed by its bytes. Its writer computes it
once, the node keeps it beside the page (RAM and disk tier) and sends it with the page on both
wires, and the reader checks it before using the page. xxh3 runs at several GB/s, so puts and
fetches pay little for it. The key is hashed in so bytes cannot pass under another page's key; the
parent is not: a key already names its whole prefix (worker/kv/pages.py), and a reader does not
always know the parent of the first page it fetches.

Not keyed: anyone can compute it, so it catches pages altered after their put (a node's memory or
disk, a bug, a byte flipped on the way), not a writer that lies. Only members may put pages
(mutual TLS); docs/operations.md's threat model says what is left open.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import xxhash

PARALLEL_MIN_BYTES = 8 << 20  # below this a second thread costs more than it saves
_helper: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()

CHECKSUM_BYTES = 16


def page_checksum(key: bytes, data) -> bytes:
    """The 16-byte checksum of page `key` holding `data` (any C-contiguous buffer)."""
    digest = page_digest(key)
    digest.update(memoryview(data).cast("B"))
    return digest.digest()


def page_digest(key: bytes):
    """The running state of page_checksum(key, ...): update() it with the page's bytes in order,
    in any pieces (a reader hashing bands as they land); digest() is then the checksum."""
    return xxhash.xxh3_128(bytes(key))


def first_mismatch(keys, pages, checksums) -> int | None:
    """Index of the first page whose bytes do not match its checksum, or None when all do."""
    for index, (key, page, checksum) in enumerate(zip(keys, pages, checksums)):
        if page_checksum(key, page) != checksum:
            return index
    return None


def first_mismatch_in_two(keys, pages, checksums) -> int | None:
    """first_mismatch over pages already in memory, every other page hashed on a second thread
    (xxhash lets go of the GIL): ~1.7 ms instead of ~3 ms for 72 MiB here, for a caller that waits
    for nothing but the check (NodeClient.pin_pages checking pages before it returns them).
    Small batches are checked on this thread."""
    global _helper
    pages = list(pages)
    if sum(memoryview(page).nbytes for page in pages) < PARALLEL_MIN_BYTES:
        return first_mismatch(keys, pages, checksums)
    with _helper_lock:
        if _helper is None:
            _helper = ThreadPoolExecutor(1, thread_name_prefix="kv-checksum")
    odd = _helper.submit(first_mismatch, keys[1::2], pages[1::2], checksums[1::2])
    even = first_mismatch(keys[::2], pages[::2], checksums[::2])
    odd = odd.result()
    found = [i for i in (None if even is None else 2 * even, None if odd is None else 2 * odd + 1) if i is not None]
    return min(found) if found else None
