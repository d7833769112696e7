"""The page pool in shared memory, for readers on the node's host: the node keeps its RAM pool in
a memfd, and a client on the same host that may (same user, plaintext data plane) maps it read-only
and copies pinned pages straight out of it, with no socket in between (kvnode/data_plane.py note 9).

Why: over a Unix socket a page is copied twice by the kernel (node -> socket buffer -> client)
beside the syscalls of both ends, ~3.8 GB/s here; a copy out of a mapping runs at memory speed
(~15 GB/s), which is what lets a fetched prefix start nearly as soon as a local one.

Design notes
1. The node's pool is a MAP_SHARED mapping of a memfd (anonymous, in RAM, never on a file system).
   Readers get a second descriptor of it opened read-only (through /proc/self/fd), so a mapping
   with write access is refused by the kernel: a reader can copy pages, never alter them.
2. A reader maps the whole pool once per node process and keeps the mapping until it drops its
   client (a restarted node has a new memfd: the old mapping is dropped with the old client).
   Populating the page tables costs ~90 ms a GiB here, so it is done while mapping (MAP_POPULATE),
   off the request path (kvnode/data_client.py note 8), for pools up to POPULATE_MAX_BYTES; a
   larger pool is mapped lazily, each page's first copy paying its faults.
3. Linux only (memfd_create, SO_PEERCRED, SCM_RIGHTS); elsewhere the pool is a plain array and
   nothing is shared.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct

import numpy as np

POPULATE_MAX_BYTES = 8 << 30  # design note 2
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def supported() -> bool:
    return hasattr(os, "memfd_create") and hasattr(socket, "SO_PEERCRED") and hasattr(socket, "SCM_RIGHTS")


class SharedPool:
    """`pages` x `page_bytes` bytes in a memfd, as a writable uint8 array (`array`), zero-filled
    and touched (serving never waits for the kernel to find a page)."""

    def __init__(self, pages: int, page_bytes: int):
        self.pages, self.page_bytes = pages, page_bytes
        size = pages * page_bytes
        self._fd = os.memfd_create("kvcache-page-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self._fd)
            raise
        self.array = np.frombuffer(self._map, dtype=np.uint8).reshape(pages, page_bytes)
        self.array.fill(0)

    def read_only_fd(self) -> int:
        """A new descriptor of the pool that allows read-only mappings only (design note 1); the
        caller closes it once sent."""
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)


def make_pool(pages: int, page_bytes: int, shared: bool) -> tuple[np.ndarray, SharedPool | None]:
    """The store's RAM pool: in shared memory when asked and the platform has it, else a plain array."""
    if shared and supported():
        pool = SharedPool(pages, page_bytes)
        return pool.array, pool
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
    """A node's pool as a read-only (pages, page_bytes) uint8 array, from the descriptor it sent
    (design notes 1-2); the mapping lives as long as the array."""
    size = pages * page_bytes
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if size <= POPULATE_MAX_BYTES else 0)
    mapping = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    return np.frombuffer(mapping, dtype=np.uint8).reshape(pages, page_bytes)
