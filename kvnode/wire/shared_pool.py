"""The page pool in shared memory, for readers on the node's host: the node keeps its RAM pool in
a memfd, and a client on the same host that may (same user, plaintext data plane) maps it read-only
and copies pinned pages straight out of it (who may: kvnode/data_plane/shared_pool_serving.py; the
reader's side: kvnode/client/shared_pool_reader.py).

Why: over a Unix socket the kernel copies a page twice (node -> socket buffer -> client) beside
both ends' syscalls; a copy out of a mapping runs at memory speed, about four times as fast
(docs/benchmarks.md). Linux only (memfd_create, SO_PEERCRED, SCM_RIGHTS); elsewhere, or where the
kernel lacks the seals (before 5.1) or a sandbox lacks memfd, the pool is a plain array.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import socket
import struct

import numpy as np

from base import mappings

# A reader populates its mapping's page tables (~80 ms a GiB) once, off the request path, for pools
# up to this; a larger one maps lazily, each page's first copy paying its faults (base/mappings.py).
POPULATE_MAX_BYTES = 8 << 30
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1; Python names it from 3.12 on
SEALS = (getattr(fcntl, "F_SEAL_SHRINK", 0x0002) | getattr(fcntl, "F_SEAL_GROW", 0x0004)
         | _F_SEAL_FUTURE_WRITE)  # see SharedPool: why these seals

log = logging.getLogger("kvnode")


def supported() -> bool:
    return (hasattr(os, "memfd_create") and hasattr(socket, "SO_PEERCRED") and hasattr(socket, "SCM_RIGHTS")
            and hasattr(fcntl, "F_ADD_SEALS"))


class SharedPool:
    """`pages` x `page_bytes` bytes in a sealed memfd, as a writable uint8 array (`array`),
    zero-filled and touched (serving never waits for the kernel to find a page); `fd` is what
    readers are sent.

    Sealed once the node mapped it (SEALS): no one can shrink or grow it, so a reader's copy never
    meets a truncated page (SIGBUS), and no new writable mapping or write() can be made of it
    through any descriptor, so only the node's own mapping writes and a reader can copy pages,
    never alter them."""

    def __init__(self, pages: int, page_bytes: int):
        self.pages, self.page_bytes = pages, page_bytes
        size = pages * page_bytes
        self.fd = os.memfd_create("kvcache-page-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
        except OSError:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self._map, dtype=np.uint8).reshape(pages, page_bytes)
        self.array.fill(0)


def make_pool(pages: int, page_bytes: int, shared: bool) -> tuple[np.ndarray, SharedPool | None]:
    """The store's RAM pool: in shared memory when asked and the platform has it, else a plain array."""
    if shared and supported():
        try:
            pool = SharedPool(pages, page_bytes)
            return pool.array, pool
        except OSError as exc:  # no memfd here (a sandbox), or a kernel without its seals
            log.warning("the page pool is not shared with readers on this host (%s); they fetch over the socket", exc)
    array = np.zeros((pages, page_bytes), dtype=np.uint8)
    array.fill(0)  # touch every page now, so serving never waits on the kernel
    return array, None


def peer_uid(sock: socket.socket) -> int | None:
    """The user id of a Unix socket's peer process; None where the kernel does not say."""
    try:
        return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]
    except (OSError, AttributeError):
        return None


def map_read_only(fd: int, pages: int, page_bytes: int) -> np.ndarray:
    """A node's pool as a read-only (pages, page_bytes) uint8 array, from the descriptor it sent,
    once it is sealed as SharedPool seals it and as large as announced (ValueError otherwise); the
    mapping lives as long as the array."""
    if pages < 1 or page_bytes < 1:
        raise ValueError(f"a pool of {pages} pages of {page_bytes} bytes is not one to map")
    size = pages * page_bytes
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & SEALS != SEALS:
        raise ValueError(f"the pool's descriptor is not sealed against resizing and writes (seals {seals:#x})")
    if os.fstat(fd).st_size < size:
        raise ValueError(f"the pool's descriptor holds {os.fstat(fd).st_size} bytes, not the {size} announced")
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    array = np.frombuffer(mapping, dtype=np.uint8).reshape(pages, page_bytes)
    if size <= POPULATE_MAX_BYTES:
        mappings.populate(array.ctypes.data, array.nbytes)
    return array


