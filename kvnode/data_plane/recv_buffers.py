"""Receive buffers for the data plane's PUTs: reused between a connection's requests while small,
bounded in total, so connections idle between requests hold little memory.

Why reuse at all: fresh memory is written several times slower than memory written before
(measured on loopback), and most PUTs carry a page or a few. Why bound it:
a connection that once sent a large PUT must not keep that buffer for as long as it stays open,
times every open connection. A buffer larger than `keep_per_connection`, or one that would take the
bytes kept over all connections past `keep_total`, serves its one request and is dropped after it.
"""

from __future__ import annotations

import threading

DEFAULT_KEEP_PER_CONNECTION = 4 * 2**20
DEFAULT_KEEP_TOTAL = 64 * 2**20


class BufferBudget:
    """Bytes of receive buffers kept between requests, over all of one server's connections."""

    def __init__(self, keep_per_connection: int = DEFAULT_KEEP_PER_CONNECTION, keep_total: int = DEFAULT_KEEP_TOTAL):
        if keep_per_connection < 0 or keep_total < 0:
            raise ValueError(f"buffer bounds must not be negative, got {keep_per_connection} and {keep_total}")
        self.keep_per_connection = keep_per_connection
        self.keep_total = keep_total
        self._kept = 0
        self._lock = threading.Lock()

    def kept_bytes(self) -> int:
        with self._lock:
            return self._kept

    def try_grow(self, old: int, new: int) -> bool:
        """Replace a kept buffer of `old` bytes by one of `new`, if both bounds allow it."""
        if new > self.keep_per_connection:
            return False
        with self._lock:
            if self._kept - old + new > self.keep_total:
                return False
            self._kept += new - old
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._kept -= nbytes
            assert self._kept >= 0, f"kept buffer bytes went negative ({self._kept})"


class ReceiveBuffer:
    """One connection's PUT buffer; close() gives its kept bytes back to the budget."""

    def __init__(self, budget: BufferBudget):
        self.budget = budget
        self._kept = bytearray()

    def view(self, size: int) -> memoryview:
        """A writable view of `size` bytes, valid until the next view(): the kept buffer when large
        enough, else a fresh one, kept from now on only within the budget."""
        if len(self._kept) >= size:
            return memoryview(self._kept)[:size]
        fresh = bytearray(size)
        if self.budget.try_grow(len(self._kept), size):
            self._kept = fresh
        return memoryview(fresh)

    def kept_bytes(self) -> int:
        return len(self._kept)

    def close(self) -> None:
        self.budget.release(len(self._kept))
        self._kept = bytearray()
