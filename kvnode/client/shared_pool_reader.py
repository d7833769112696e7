"""The client's side of a node's shared pool (kvnode/wire/shared_pool.py; the node's side:
kvnode/data_plane/shared_pool_serving.py): the pool mapped read-only, and pages copied out of it. Each
DataPlaneClient (data_client.py) holds one SharedPoolReader and, over the Unix socket of a
plaintext node, fetches through it while the pool is mapped: GET_SLOTS pins the pages and names
their slots, the client copies them out and releases them (a round trip of its own per batch). The
caller checks the checksums as always.

The pool is mapped once per node process, only from a peer of this user or root and a descriptor
sealed against writes and resizing, and dropped with the client or when the node's socket name is
found gone (a restarted node has a new memfd; the old one is freed once no reader maps it).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import grpc
import numpy as np

from kvnode.wire import data_frames as dw
from kvnode.wire import shared_pool
from kvnode.wire.checksum import CHECKSUM_BYTES
from kvnode.client.data_client_io import (DataPlaneError, payload_or_status, receive, receive_scattered,
                                          reply_header, send_request)

MAP_TIMEOUT_S = 30.0  # the shared pool's mapping, on its own thread (see start_mapping)
_MAP_RETRY_S = 30.0  # after a mapping failed for a reason that may pass (a busy socket, a timeout)
_SLOT_ENTRY = CHECKSUM_BYTES + dw.SLOT.size

# The DataPlaneClient's: a new connection to the node's Unix socket by a deadline (None: it did not
# take one), and a connection handed back to its pool of idle ones.
Connect = Callable[[float], "socket.socket | None"]
GiveBack = Callable[[socket.socket], None]

log = logging.getLogger("kvnode.client")
# Of every mapping made in this process, unique, so a caller that maps the pool itself tells a
# remapped pool (a restarted node's) from the one its slots index.
_GENERATIONS = itertools.count(1)


@dataclass(frozen=True)
class SharedPoolFile:
    """The node's pool as a caller that reads pages in place maps it (NodeClient.pin_pages): `fd` is
    the caller's own descriptor of the sealed memfd (it closes it), `pages` x `page_bytes` its shape,
    `generation` the mapping's."""

    fd: int
    pages: int
    page_bytes: int
    generation: int


class SharedPoolReader:
    """The node's pool as one DataPlaneClient maps it: `state` is "unasked", "mapping", "mapped" or
    "refused"; `pool` the mapping once it is made."""

    def __init__(self, address: str, enabled: bool):
        self.address = address  # the node's data plane, for log lines and errors
        self.state = "unasked" if enabled else "refused"
        self.pool: np.ndarray | None = None
        self.generation = 0  # of the mapping in `pool` (_GENERATIONS); 0: none yet
        # The mapped memfd's, kept open to dup (pool_file) and closed as the mapping is dropped, under
        # the lock, so a dup never meets a closed (or reused) descriptor.
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._mapping_done = threading.Event()  # a new one each time a mapping is begun
        self._map_again_at = 0.0

    def close(self) -> None:
        """Drop the mapping (it goes with the last array that uses it), and map no more."""
        with self._lock:
            self._closed = True
            self.pool = None
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self.state == "mapped":
                self.state = "refused"

    def mapping(self) -> tuple[np.ndarray | None, int]:
        """The mapped pool and its generation, read together; (None, 0) when unmapped."""
        with self._lock:
            return (self.pool, self.generation) if self.pool is not None else (None, 0)

    def pool_file(self) -> SharedPoolFile | None:
        """A new descriptor of the mapped pool's memfd, for the caller to map and close; None while
        nothing is mapped."""
        with self._lock:
            if self.pool is None or self._fd is None:
                return None
            pages, page_bytes = self.pool.shape
            return SharedPoolFile(os.dup(self._fd), pages, page_bytes, self.generation)

    def map_now(self, connect: Connect, give_back: GiveBack, timeout_s: float) -> bool:
        """Map the node's pool now, on this thread (or wait for the thread mapping it), unless it
        was refused; whether it is mapped."""
        if self._claim_mapping():
            self._map_pool(connect, give_back, timeout_s)
        elif self.state == "mapping":
            self._mapping_done.wait(timeout_s)
        return self.state == "mapped"

    def state_after(self, wait_s: float) -> str:
        """`state`, once the mapping under way (if one is) ended or `wait_s` passed; begins none."""
        if self.state == "mapping":
            self._mapping_done.wait(wait_s)
        return self.state

    def start_mapping(self, connect: Connect, give_back: GiveBack) -> None:
        """Map the node's pool on a thread of its own, unless asked already: started by the first call
        (or NodeClient.prepare_data_plane), so no request waits for it; until it is mapped, pages
        come over the socket."""
        if self._claim_mapping():
            threading.Thread(target=self._map_pool, args=(connect, give_back, MAP_TIMEOUT_S), name="kvnode-pool-map",
                             daemon=True).start()

    def _claim_mapping(self) -> bool:
        with self._lock:
            if self.state != "unasked" or self._closed or time.monotonic() < self._map_again_at:
                return False
            self.state, self._mapping_done = "mapping", threading.Event()
            return True

    def _map_pool(self, connect: Connect, give_back: GiveBack, timeout_s: float) -> None:
        """MAP_POOL on a new connection to the Unix socket (`connect`, given back once the pool is
        mapped): the pool mapped; refused for good when the node says no (TLS, another user,
        --no-shared-pool, a node before the op) or its descriptor is not sealed and sized as
        promised; else (a busy socket, a timeout) asked again after _MAP_RETRY_S."""
        pool, fd, why, for_good, sock = None, None, "", False, None
        deadline = time.monotonic() + timeout_s
        try:
            sock = connect(deadline)
            if sock is None:
                why = "its unix socket did not take the connection"
            else:
                sock.settimeout(None)
                dw.set_kernel_timeouts(sock, max(0.001, deadline - time.monotonic()))
                uid = shared_pool.peer_uid(sock)
                if uid not in (os.geteuid(), 0):  # not the node's socket, or not ours to trust
                    why, for_good = f"the process on its unix socket runs as user {uid}, not as this one or root", True
                else:
                    sock.sendall(dw.request_header(dw.OP_MAP_POOL, 0))
                    pool, fd = self._receive_pool(sock, deadline)
        except DataPlaneError as exc:  # FAILED_PRECONDITION: not offered; INVALID_ARGUMENT: a node before the op
            why = f"{exc.code.name}: {exc.details}"
            for_good = exc.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
        except ValueError as exc:  # a descriptor not sealed or sized as promised
            why, for_good = str(exc), True
        except Exception as exc:  # OSError, MemoryError, ...: this try only
            why = str(exc) or repr(exc)
        with self._lock:
            if pool is not None and not self._closed:
                self.pool, self.state, self._fd, self.generation = pool, "mapped", fd, next(_GENERATIONS)
            else:
                if fd is not None:
                    os.close(fd)
                pool = None
                self.state = "refused" if for_good else "unasked"
                self._map_again_at = time.monotonic() + _MAP_RETRY_S
            self._mapping_done.set()
        if pool is None:
            log.info("kvnode data plane %s: pages come over the socket, not out of the node's shared pool (%s)%s",
                     self.address, why, "" if for_good else f"; asked again in {_MAP_RETRY_S:.0f} s")
        if sock is not None:
            if pool is not None:
                give_back(sock)
            else:
                sock.close()

    @staticmethod
    def _receive_pool(sock: socket.socket, deadline: float) -> tuple[np.ndarray, int]:
        """The MAP_POOL reply: its descriptor mapped (shared_pool.map_read_only), and the descriptor, kept
        open (see `_fd`); or the node's status raised."""
        data, fds, _, _ = socket.recv_fds(sock, dw.REPLY.size, 1, getattr(socket, "MSG_CMSG_CLOEXEC", 0))
        kept = None
        try:
            if not data:
                raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, "connection closed before a reply")
            header = memoryview(bytearray(dw.REPLY.size))
            header[: len(data)] = data
            receive(sock, header[len(data):], deadline)
            payload = payload_or_status(sock, header, deadline)
            if payload != dw.POOL_REPLY.size or len(fds) != 1:
                raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"a MAP_POOL reply of {payload} bytes and {len(fds)} "
                                     "descriptors is not one this client reads")
            body = memoryview(bytearray(dw.POOL_REPLY.size))
            receive(sock, body, deadline)
            pool = shared_pool.map_read_only(fds[0], *dw.POOL_REPLY.unpack(body))
            kept = fds[0]
            return pool, kept
        finally:
            for fd in fds:
                if fd != kept:
                    os.close(fd)

    def pool_for(self, sock) -> np.ndarray | None:
        """The mapped pool when this connection can fetch out of it (a plain Unix one), else None."""
        pool = self.pool
        return pool if pool is not None and getattr(sock, "family", None) == socket.AF_UNIX else None

    def copy_pages(self, sock: socket.socket, pool: np.ndarray, keys: Sequence[bytes],
                   destination: Callable[[], tuple[list[np.ndarray] | np.ndarray, memoryview]],
                   deadline: float, reused: bool) -> None:
        """GET_SLOTS: destination() gives (pages, checksums) once the node
        answered, as out_for does for a GET; page i is copied out of the pool into pages[i] (or
        received, when the node has it in no slot) and its checksum into `checksums`; then the
        pages are released."""
        send_request(sock, [dw.get_request(keys, dw.OP_GET_SLOTS)], deadline, reused, self.address)
        table, payload, slots = receive_slot_table(sock, len(keys), deadline, reused, self.address)
        slot_array = np.array(slots, dtype=np.uint64)
        slotted = slot_array != dw.NO_SLOT
        unslotted = np.flatnonzero(~slotted).tolist()
        page_bytes = pool.shape[1]
        if payload != table.nbytes + len(unslotted) * page_bytes or bool(np.any(slot_array[slotted] >= len(pool))):
            raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"node answers a GET_SLOTS of {len(keys)} pages with "
                                 f"{payload} bytes, naming slots {sorted(set(slots) - {dw.NO_SLOT})} of a pool of "
                                 f"{len(pool)}: not one this client reads")
        pages, checksums = destination()
        if (pages.shape[1:] != (page_bytes,) if isinstance(pages, np.ndarray)
                else any(page.nbytes != page_bytes for page in pages)):
            raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"the node's shared pool holds pages of {page_bytes} "
                                 f"bytes, the caller's of {pages[0].nbytes}")
        entries = np.frombuffer(table, dtype=np.uint8).reshape(len(keys), _SLOT_ENTRY)
        np.frombuffer(checksums, dtype=np.uint8).reshape(len(keys), CHECKSUM_BYTES)[:] = entries[:, :CHECKSUM_BYTES]
        if unslotted:
            receive_scattered(sock, [memoryview(pages[i]) for i in unslotted], deadline)
        # One gather for a caller's single array (few Python steps: a fill's fixed cost), else a copy a page.
        if isinstance(pages, np.ndarray) and not unslotted:
            np.take(pool, slot_array.astype(np.intp), axis=0, out=pages, mode="clip")  # slots checked above
        else:
            for page, slot in zip(pages, slots):
                if slot != dw.NO_SLOT:
                    np.copyto(page, pool[slot])
        try:
            sock.sendall(dw.RELEASE)
        except OSError as exc:  # the node unpins them as the connection goes
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"connection broke before the release: {exc}") from None


def receive_slot_table(sock: socket.socket, count: int, deadline: float, reused: bool,
                       address: str) -> tuple[memoryview, int, list[int]]:
    """A GET_SLOTS reply's header and table: the table, the whole payload's
    length (the table, then the pages without a slot), and each page's slot; the pages stay
    pinned until the RELEASE."""
    payload = reply_header(sock, deadline, reused, address)
    table = memoryview(bytearray(count * _SLOT_ENTRY))
    if payload < table.nbytes:
        raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"node answers {payload} bytes to a GET_SLOTS of "
                             f"{count} pages, expected at least {table.nbytes}")
    receive(sock, table, deadline)
    entries = np.frombuffer(table, dtype=np.uint8).reshape(count, _SLOT_ENTRY)
    return table, payload, entries[:, CHECKSUM_BYTES:].view(">u8").ravel().tolist()   # dw.SLOT, one read for all


def table_checksum(table: memoryview, index: int) -> memoryview:
    """Page `index`'s checksum in a GET_SLOTS table."""
    return table[index * _SLOT_ENTRY : index * _SLOT_ENTRY + CHECKSUM_BYTES]


def page_arrays(destination: tuple, count: int) -> tuple[list[np.ndarray] | np.ndarray, memoryview]:
    """out_for's (pages, checksums) with the pages as `count` uint8 arrays, one a page."""
    out, checksums = destination
    if isinstance(out, list):
        return [np.frombuffer(page, dtype=np.uint8) for page in out], checksums
    return np.frombuffer(out, dtype=np.uint8).reshape(count, -1), checksums
