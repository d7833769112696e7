"""One range of virtual memory for the worker's KV blocks and, after them, read-only windows onto
the shared page pools of kvnodes on this host, so that a page pinned in a node's pool has a block
id like any other and paged attention reads it where it lies (worker/kv/pages_in_place.py).

Only the worker's own blocks are ever written: window blocks are read by the forward and copied
out of, never written (the mapping is read-only, as the node's seals make it anyway). Where the
range cannot be reserved (not Linux, a limit on address space) there is no arena: the pool is a
plain array and pages are copied into blocks as before.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from base import mappings

log = logging.getLogger("worker.arena")

WINDOW_SPACE_BYTES = 64 << 30  # address space (not memory) for windows onto node pools; a bigger pool is copied from
_PAGE = mmap.PAGESIZE
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_POPULATE_MAX_BYTES = 8 << 30
_MADV_HUGEPAGE = 14
_FAILED = ctypes.c_void_p(-1).value
_LIBC = mappings.LIBC  # None where there is no arena (then the pool is a plain array)


def _mmap(address: int | None, length: int, prot: int, flags: int, fd: int = -1) -> int:
    result = _LIBC.mmap(address, length, prot, flags, fd, 0)
    if result in (None, _FAILED):
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of {length} bytes failed: {os.strerror(errno)}")
    if address is not None and result != address:
        raise OSError(0, f"mmap placed {length} bytes at {result:#x}, not at {address:#x}")
    return result


_ARENAS: "weakref.WeakValueDictionary[int, BlockArena]" = weakref.WeakValueDictionary()  # by id of `local`


def arena_of(pool: np.ndarray) -> "BlockArena | None":
    """The arena whose own blocks `pool` is, if any."""
    arena = _ARENAS.get(id(pool))
    return arena if arena is not None and arena.local is pool else None


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(eq=False)  # a window is itself, whatever its fields say
class Window:
    """A node's pool mapped into the arena: its slot s is block `first_block + s` of `all_blocks`."""

    first_block: int
    generation: int  # of the node client's mapping it mirrors: slots of another generation are not its
    _offset: int
    _length: int
    pins: int = 0  # readers using it now: it is unmapped only once none is (see detach)
    detached: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class BlockArena:
    """`num_blocks` writable blocks of `block_shape` in `dtype` (`local`), and read-only windows
    after them (`attach`); `all_blocks` views the whole range, windows included.

    The range is reserved once (PROT_NONE, no memory behind it): the worker's own blocks are mapped
    read-write at its start, and a node's pool file read-only into the space after them (MAP_FIXED
    over the reservation) on a block boundary. Python's mmap cannot map at an address, hence
    libc's mmap through ctypes."""

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype, window_space: int = WINDOW_SPACE_BYTES):
        if _LIBC is None:
            raise OSError(0, "no arena on this platform: libc mmap is not available (the pool is a plain array)")
        dtype = np.dtype(dtype)
        self.block_bytes = int(np.prod(block_shape)) * dtype.itemsize
        self._align = math.lcm(self.block_bytes, _PAGE)  # windows start on a block and on a page
        self._windows_start = _round_up(num_blocks * self.block_bytes, self._align)
        self._size = self._windows_start + _round_up(window_space, self._align)
        self._base = _mmap(None, self._size, _PROT_NONE,
                           mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        try:
            _mmap(self._base, _round_up(num_blocks * self.block_bytes, _PAGE), mmap.PROT_READ | mmap.PROT_WRITE,
                  mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED)
        except OSError:
            _LIBC.munmap(self._base, self._size)
            raise
        # Huge pages where the kernel gives them on request, as NumPy asks for its large arrays.
        _LIBC.madvise(self._base, _round_up(num_blocks * self.block_bytes, _PAGE), _MADV_HUGEPAGE)
        buffer = (ctypes.c_char * self._size).from_address(self._base)
        # The range is unmapped when the last array viewing it is collected, and not at exit, when a
        # daemon thread may still be reading a window (the kernel unmaps it with the process).
        weakref.finalize(buffer, _LIBC.munmap, self._base, self._size).atexit = False
        self.all_blocks = np.frombuffer(buffer, dtype=dtype).reshape(self._size // self.block_bytes, *block_shape)
        self.local = self.all_blocks[:num_blocks]
        _ARENAS[id(self.local)] = self
        self._lock = threading.Lock()
        self._windows: list[Window] = []  # attached, by offset

    @classmethod
    def make(cls, num_blocks: int, block_shape: tuple[int, ...], dtype) -> "BlockArena | None":
        """An arena, or None where none can be had (no libc mmap here, or the range cannot be reserved)."""
        try:
            return cls(num_blocks, block_shape, dtype)
        except OSError as exc:
            log.info("KV blocks in a plain array: %s; fetched pages are copied into them", exc)
            return None

    def attach(self, fd: int, pages: int, page_bytes: int, generation: int) -> Window:
        """Map a node's pool file (`pages` x `page_bytes`, sealed read-only by its node) after the
        local blocks; ValueError when its pages are not this arena's blocks or no space is left."""
        if page_bytes != self.block_bytes:
            raise ValueError(f"the node's pages are {page_bytes} bytes, these blocks {self.block_bytes}")
        length = _round_up(pages * page_bytes, self._align)
        with self._lock:  # the space is claimed here, mapped below without the lock (populating takes a while)
            offset = self._free_offset(length)
            if offset is None:
                raise ValueError(f"no room left for a window of {length} bytes in the arena's "
                                 f"{self._size - self._windows_start} bytes of window space")
            window = Window(offset // self.block_bytes, generation, offset, length)
            self._windows.append(window)
            self._windows.sort(key=lambda w: w._offset)
        mapped = _round_up(pages * page_bytes, _PAGE)
        try:
            _mmap(self._base + offset, mapped, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd)
        except OSError:
            self._unmap(window)  # the space reserved again: a failed MAP_FIXED may have unmapped it
            raise
        if mapped <= _POPULATE_MAX_BYTES:  # no forward then faults on the window's pages
            mappings.populate(self._base + offset, mapped)
        return window

    def pin(self, window: Window) -> bool:
        """Count one more reader of `window`; False when it is detached."""
        with window._lock:
            if window.detached:
                return False
            window.pins += 1
            return True

    def unpin(self, window: Window) -> None:
        with window._lock:
            window.pins -= 1
            gone = window.detached and window.pins == 0
        if gone:
            self._unmap(window)

    def detach(self, window: Window) -> None:
        """Unmap `window` (the space reserved again) now, or, while readers use it, once its last
        reader unpins it: it is unmapped only when nothing reads it any more."""
        with window._lock:
            if window.detached:
                return
            window.detached = True
            gone = window.pins == 0
        if gone:
            self._unmap(window)

    def _unmap(self, window: Window) -> None:
        with self._lock:
            _mmap(self._base + window._offset, window._length, _PROT_NONE,
                  mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED)
            self._windows.remove(window)

    def _free_offset(self, length: int) -> int | None:
        """The first gap of `length` bytes in the window space (first fit)."""
        start = self._windows_start
        for window in self._windows:
            if window._offset - start >= length:
                return start
            start = window._offset + window._length
        return start if self._size - start >= length else None
