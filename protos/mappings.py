"""Filling a memory mapping's page tables without stalling the rest of the process.

A reader of a kvnode's shared pool (the node's client, the worker's block arena) fills the page
tables of its mapping once, ~80 ms a GiB here, so no copy or forward pays a fault per 4 KiB
later. Neither MAP_POPULATE through Python's mmap nor one madvise over the whole mapping will do:
Python's mmap holds the GIL through the call, and the kernel holds the process's memory-map lock
for the whole range, so every thread that allocates a large array or starts a thread waits as
long (a worker's engine step stalled ~260 ms when it met a node with a 1 GiB pool).
madvise(MADV_POPULATE_READ) through ctypes runs without the GIL, and in 32 MiB steps the lock is
let go between them: other threads wait ~3 ms at most.
"""

from __future__ import annotations

import ctypes
import sys

POPULATE_STEP_BYTES = 32 << 20
_MADV_POPULATE_READ = 22  # Linux 5.14


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # a CDLL call releases the GIL for its duration
        libc.madvise.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def populate(address: int, length: int) -> bool:
    """Fill the page tables of the mapped range [address, address + length) for reading, in
    steps (module docstring); whether the kernel did (False: a kernel before 5.14, or not Linux,
    and each page then faults in at its first read)."""
    if _LIBC is None:
        return False
    for offset in range(0, length, POPULATE_STEP_BYTES):
        if _LIBC.madvise(address + offset, min(POPULATE_STEP_BYTES, length - offset), _MADV_POPULATE_READ) != 0:
            return False
    return True
