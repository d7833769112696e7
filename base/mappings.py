"""Filling a memory mapping's page tables without stalling the rest of the process.

A reader of a kvnode's shared pool (the node's client, the worker's block arena) fills the page
tables of its mapping once, ~80 ms a GiB here, so no copy or forward pays a fault per 4 KiB
later. Neither MAP_POPULATE through Python's mmap nor one madvise over the whole mapping will do:
Python's mmap holds the GIL through the call, and the kernel holds the process's memory-map lock
for the whole range, so every thread that allocates a large array or starts a thread waits as
long (a worker's engine step stalled ~260 ms when it met a node with a 1 GiB pool).
madvise(MADV_POPULATE_READ) through ctypes runs without the GIL, and in 32 MiB steps the lock is
let go between them: other threads wait ~3 ms at most. A kernel without that advice (before
5.14) has the pages read once instead, a byte a page, by NumPy (which lets the GIL go too).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys

import numpy as np

POPULATE_STEP_BYTES = 32 << 20
_MADV_POPULATE_READ = 22  # Linux 5.14

log = logging.getLogger("kvcache.mappings")


def _libc():
    """libc's mmap, munmap and madvise through ctypes (Python's mmap cannot map at an address or
    populate without the GIL), or None where there is no such libc (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # a CDLL call releases the GIL for its duration
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


LIBC = _libc()
_advice_works = LIBC is not None  # until the kernel says otherwise


def populate(address: int, length: int) -> None:
    """Fill the page tables of the readable mapped range [address, address + length) (page
    aligned), in steps (module docstring)."""
    global _advice_works
    for offset in range(0, length, POPULATE_STEP_BYTES):
        step = min(POPULATE_STEP_BYTES, length - offset)
        if _advice_works and LIBC.madvise(address + offset, step, _MADV_POPULATE_READ) == 0:
            continue
        if _advice_works:
            _advice_works = False
            errno = ctypes.get_errno()
            log.info("madvise(MADV_POPULATE_READ) refused (%s): mappings are populated by reading them",
                     os.strerror(errno))
        _read_a_byte_a_page(address + offset, step)


def _read_a_byte_a_page(address: int, length: int) -> None:
    pages = np.frombuffer((ctypes.c_uint8 * length).from_address(address), dtype=np.uint8)
    pages[:: mmap.PAGESIZE].max()
