"""The client side of a kvnode's data plane (framing: kvnode/wire/data_frames.py): GET into the
caller's buffer with recv_into, PUT straight from the caller's pages, LOOKUP. NodeClient uses it;
nothing else should. One request's socket I/O: data_client_io.py; pages copied out of the
node's shared pool: shared_pool_reader.py.

A small pool of connections, safe to share between threads: a call takes an idle connection (or
opens one) and gives it back once its reply was read in full; any failure closes it instead.
Sockets are blocking, with kernel timeouts set to what is left of the call's deadline (no poll
before each recv), also under TLS, which runs over memory BIOs on the plain socket (TlsStream)
with wrap_socket's certificate checks.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import ssl
import threading
import time
from typing import Callable, Sequence

import grpc
import numpy as np

from kvnode.wire import data_frames as dw
from kvnode.wire.checksum import CHECKSUM_BYTES
from kvnode.client.data_client_io import (DataPlaneError, StaleConnection, receive, receive_scattered,
                                          reply_header, send_request)
from kvnode.client.shared_pool_reader import MAP_TIMEOUT_S, SharedPoolFile, SharedPoolReader, page_arrays
from kvnode.wire.tls_stream import TlsStream

_MAX_IDLE = 4
_UNIX_GONE = (errno.ECONNREFUSED, errno.ENOENT)  # nobody listens on the name: the node exited or restarted
_UNIX_FORBIDDEN = (errno.EAFNOSUPPORT, errno.EPERM, errno.EACCES)  # no unix socket can be made here

log = logging.getLogger("kvnode.client")


class DataPlaneClient:
    """`tls`: an ssl client context (base.security.Credentials.client_context): every connection
    is TLS, checked against the node's certificate, and presents ours (mutual TLS). `unix_name`:
    the node's abstract Unix socket, used when `host` is a loopback address: faster than TCP over
    loopback, and both live in the network namespace, so reaching one means reaching the other;
    everything else (TLS, timeouts, deadlines, the pool) is as over TCP (see _connect_unix for a
    name gone). `shared_memory=False` never maps the node's pool (shared_pool_reader.py)."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None = None, unix_name: str = "",
                 shared_memory: bool = True):
        self.host, self.port = host, port
        self.tls = tls
        self.offered_unix = unix_name
        self.unix_name = unix_name if unix_name and _is_loopback(host) else ""
        self.unix_gone = False  # the node's unix socket name had nobody listening (see _connect_unix)
        self._told_unix_busy = False
        self.connected_once = False
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        # The node's pool, mapped read-only in the background (shared_pool_reader.py).
        self.shared_pool = SharedPoolReader(self.address, bool(shared_memory and self.unix_name and tls is None))

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def get_into(self, keys: Sequence[bytes], out: memoryview, checksums: memoryview, timeout_s: float) -> None:
        """The pages of `keys`, back to back, received straight into `out` (len(keys) x page_bytes bytes),
        and their checksums into `checksums` (len(keys) x 16 bytes); the caller checks them."""
        self.get_batches([keys], lambda _: (out, checksums), lambda _: None, timeout_s)

    def get_batches(self, batches: Sequence[Sequence[bytes]],
                    out_for: Callable[[int], tuple[memoryview | list[memoryview], memoryview]],
                    landed: Callable[[int], None], timeout_s: float) -> None:
        """GETs of several batches of keys on one connection, all sent before the first reply is read:
        the node reads a connection's requests one at a time and answers them in order, so across
        hosts a fetch in batches costs one round trip, not one per batch.
        out_for(i) gives (pages, checksums), where batch i's pages (one buffer, or a list of one a
        page) and their checksums (16 bytes each) are received; it is asked once that batch's reply
        began (it may wait until that memory is free). landed(i) is called once both arrived, in
        order; the caller checks them."""
        requests = [dw.get_request(keys) for keys in batches]

        def exchange(sock: socket.socket, deadline: float, reused: bool) -> None:
            pool = self.shared_pool.pool_for(sock)
            if pool is not None:  # mapped: one batch at a time, each copied out of the pool
                for number, keys in enumerate(batches):
                    self.shared_pool.copy_pages(sock, pool, keys, lambda: page_arrays(out_for(number), len(keys)),
                                            deadline, reused and number == 0)
                    landed(number)
                return
            send_request(sock, requests, deadline, reused, self.address)
            for number in range(len(batches)):
                payload = reply_header(sock, deadline, reused and number == 0, self.address)
                out, checksums = out_for(number)
                if checksums.nbytes != len(batches[number]) * CHECKSUM_BYTES:
                    raise ValueError(f"batch {number}: room for {checksums.nbytes} bytes of checksums, expected "
                                     f"{len(batches[number]) * CHECKSUM_BYTES} ({CHECKSUM_BYTES} a page)")
                size = sum(page.nbytes for page in out) if isinstance(out, list) else out.nbytes
                if payload != checksums.nbytes + size:
                    raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"node answers {payload} bytes to batch {number}, "
                                         f"expected {checksums.nbytes + size} (checksums and pages)")
                receive(sock, checksums, deadline)  # a version 2 reply: the checksums, then the pages
                if isinstance(out, list):
                    receive_scattered(sock, out, deadline)
                else:
                    receive(sock, out, deadline)
                landed(number)

        self._call(exchange, timeout_s)

    def get_bands(self, keys: Sequence[bytes], outs: Sequence[memoryview], checksums: memoryview, band_bytes: int,
                  landed: Callable[[int], None], timeout_s: float) -> None:
        """The pages of `keys` in bands of band_bytes, so the caller may use band b of every page while
        the later bands are on the way: page i into outs[i] (each
        page_bytes long), the checksums into `checksums` (16 bytes a page) before any band, then
        landed(b) once band b of every page arrived; the caller checks the checksums. A band size
        the node refuses raises DataPlaneError(INVALID_ARGUMENT); so does a node that predates the op
        (data_frames.is_unknown_op tells that one)."""
        if len(outs) != len(keys) or not keys:
            raise ValueError(f"{len(outs)} page buffers for {len(keys)} keys: give one per key, at least one")
        page_bytes = outs[0].nbytes
        if any(out.nbytes != page_bytes for out in outs):
            raise ValueError(f"page buffers of {sorted({out.nbytes for out in outs})} bytes: all must be one page long")
        if checksums.nbytes != len(keys) * CHECKSUM_BYTES:
            raise ValueError(f"room for {checksums.nbytes} bytes of checksums, expected "
                             f"{len(keys) * CHECKSUM_BYTES} ({CHECKSUM_BYTES} a page)")
        bands = dw.caller_band_bounds(page_bytes, band_bytes)
        request = dw.get_bands_request(keys, band_bytes)
        outs = [memoryview(out).cast("B") for out in outs]

        def exchange(sock: socket.socket, deadline: float, reused: bool) -> None:
            pool = self.shared_pool.pool_for(sock)
            if pool is not None:  # mapped: whole pages out of the pool, then every band at once
                self.shared_pool.copy_pages(
                    sock, pool, keys, lambda: ([np.frombuffer(out, dtype=np.uint8) for out in outs], checksums),
                    deadline, reused)
                for band in range(len(bands)):
                    landed(band)
                return
            send_request(sock, [request], deadline, reused, self.address)
            payload = reply_header(sock, deadline, reused, self.address)
            if payload != checksums.nbytes + len(keys) * page_bytes:
                raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"node answers {payload} bytes, expected "
                                     f"{checksums.nbytes + len(keys) * page_bytes} (checksums and pages)")
            receive(sock, checksums, deadline)
            for band, (start, end) in enumerate(bands):
                receive_scattered(sock, [out[start:end] for out in outs], deadline)
                landed(band)

        self._call(exchange, timeout_s)

    def put(self, keys: Sequence[bytes], parents: Sequence[bytes], checksums: Sequence[bytes],
            pages: Sequence[memoryview], page_bytes: int, timeout_s: float) -> list[int]:
        """Store pages with their checksums; one PutOutcome value per page."""
        head = dw.put_request_head(keys, parents, checksums, page_bytes)

        def exchange(sock: socket.socket, deadline: float, reused: bool) -> list[int]:
            send_request(sock, [head, *pages], deadline, reused, self.address)
            count = reply_header(sock, deadline, reused, self.address)
            if count != len(keys):
                raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"node answers {count} outcomes for {len(keys)} pages")
            outcomes = memoryview(bytearray(count))
            receive(sock, outcomes, deadline)
            return list(outcomes)

        return self._call(exchange, timeout_s)

    def lookup(self, keys: Sequence[bytes], lease_ms: int, timeout_s: float) -> int:
        """How many of `keys`, from the first, the node holds, leased for lease_ms when > 0 (LOOKUP,
        kvnode/wire/data_frames.py). A node that predates the op raises DataPlaneError(INVALID_ARGUMENT) that
        data_frames.is_unknown_op tells."""
        request = dw.lookup_request(keys, lease_ms)

        def exchange(sock: socket.socket, deadline: float, reused: bool) -> int:
            send_request(sock, [request], deadline, reused, self.address)
            payload = reply_header(sock, deadline, reused, self.address)
            if payload != dw.HITS.size:
                raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"node answers a LOOKUP with {payload} bytes, "
                                     f"expected {dw.HITS.size}")
            reply = memoryview(bytearray(dw.HITS.size))
            receive(sock, reply, deadline)
            (hits,) = dw.HITS.unpack(reply)
            if hits > len(keys):
                raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"node answers {hits} hits to {len(keys)} keys")
            return hits

        return self._call(exchange, timeout_s)

    def close(self) -> None:
        self.shared_pool.close()  # the mapping goes with the last array that uses it
        with self._lock:
            self._closed = True
        self.drop_idle()

    # ---- the shared pool (shared_pool_reader.py) ---------------------------

    @property
    def pool_state(self) -> str:
        """The node's pool, mapped read-only: "unasked", "mapping", "mapped" or "refused"."""
        return self.shared_pool.state

    def map_pool(self, timeout_s: float = MAP_TIMEOUT_S) -> bool:
        """Map the node's pool now, on this thread (or wait for the thread mapping it), unless it
        was refused; whether it is mapped."""
        return self.shared_pool.map_now(self._connect_unix, self.give_back, timeout_s)

    def pool_state_after(self, wait_s: float) -> str:
        """pool_state once the mapping under way (if one is) ended, or after `wait_s`; begins none."""
        return self.shared_pool.state_after(wait_s)

    def start_mapping(self) -> None:
        """Map the node's pool on a thread of its own, unless asked already."""
        self.shared_pool.start_mapping(self._connect_unix, self.give_back)

    def shared_pool_file(self) -> SharedPoolFile | None:
        """The mapped pool as a descriptor of the caller's own (for pin_pages), or None."""
        return self.shared_pool.pool_file()

    # ---- plumbing ----------------------------------------------------------------

    def _call(self, exchange, timeout_s: float):
        """`exchange` on a connection. A pooled one may have been closed by the node while idle: a call
        that fails on it before any byte of its reply arrived (StaleConnection) is sent once more on a
        new one (GET, PUT and LOOKUP are all idempotent)."""
        if self.pool_state == "unasked":
            self.start_mapping()  # in the background: this call does not wait for it
        deadline = time.monotonic() + timeout_s
        for attempt in range(2):
            sock, reused = self.take_connection(deadline, fresh=attempt > 0)
            try:
                dw.set_kernel_timeouts(sock, max(0.001, deadline - time.monotonic()))
                result = exchange(sock, deadline, reused and attempt == 0)
            except StaleConnection:
                sock.close()
                self.drop_idle()  # the node closed idle connections: the others are as stale
                continue
            except BaseException:
                sock.close()
                raise
            self.give_back(sock)
            return result
        raise AssertionError("a retried data plane call asked for another retry")

    def take_connection(self, deadline: float, fresh: bool = False) -> tuple[socket.socket, bool]:
        """(a connection, whether it was idle in the pool): a pooled one unless `fresh`, else a new
        one (Unix socket first); the caller gives it back or closes it."""
        with self._lock:
            if self._idle and not fresh:
                return self._idle.pop(), True
        sock = self._connect_unix(deadline) if self.unix_name else None
        if sock is None:
            sock = self._connect_tcp(deadline)
        sock.settimeout(None)  # blocking; deadlines come from kernel timeouts (_call sets them)
        dw.set_no_delay(sock)
        if self.tls is not None:
            sock = self._handshake(sock, deadline)
        self.connected_once = True
        return sock, False

    @property
    def transport(self) -> str:
        """"shared memory" once the node's pool is mapped, "unix" while
        the node's Unix socket is used, else "tcp"."""
        if self.unix_name and self.shared_pool.pool is not None:
            return "shared memory"
        return "unix" if self.unix_name else "tcp"

    def _connect_unix(self, deadline: float) -> socket.socket | None:
        """A connection to the node's abstract socket, or None: this connection then goes over TCP.
        A name nobody listens on (ECONNREFUSED, ENOENT: the node exited, or restarted under a new
        name) or a process that may not make Unix sockets puts the client on TCP for good, and a gone
        name sets `unix_gone` so NodeClient reads Info again; anything else (EAGAIN from a full
        backlog, say) is this connection's alone and the socket is tried again for the next."""
        sock = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.connect(b"\0" + self.unix_name.encode("ascii"))
            return sock
        except OSError as exc:
            if sock is not None:
                sock.close()
            gone = exc.errno in _UNIX_GONE
            if gone or sock is None and exc.errno in _UNIX_FORBIDDEN:
                log.info("kvnode data plane %s: its unix socket @%s %s (%s); using TCP", self.address, self.unix_name,
                         "is gone" if gone else "cannot be used from this process", exc)
                self.unix_name = ""
                self.unix_gone = gone
                self.shared_pool.close()  # a gone node's memory is freed once no reader maps it
            else:
                (log.debug if self._told_unix_busy else log.info)(
                    "kvnode data plane %s: its unix socket @%s did not take a connection (%s); that connection "
                    "goes over TCP, the next tries the unix socket again", self.address, self.unix_name, exc)
                self._told_unix_busy = True
            return None

    def _connect_tcp(self, deadline: float) -> socket.socket:
        try:
            return socket.create_connection((self.host, self.port), timeout=max(0.001, deadline - time.monotonic()))
        except socket.timeout:
            raise DataPlaneError(grpc.StatusCode.DEADLINE_EXCEEDED, f"connecting to {self.address} timed out",
                                 connect_failed=not self.connected_once) from None
        except OSError as exc:
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"cannot connect to {self.address}: {exc}",
                                 connect_failed=True) from None

    def _handshake(self, sock: socket.socket, deadline: float) -> TlsStream:
        """TLS on a new connection. A node that closes it unanswered (at its connection limit) or
        whose certificate fails makes a DataPlaneError; never connected before, `connect_failed`."""
        try:
            dw.set_kernel_timeouts(sock, max(0.001, deadline - time.monotonic()))
            return TlsStream(sock, self.tls, server_hostname=self.host, deadline=deadline)
        except ssl.SSLCertVerificationError as exc:
            sock.close()
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"TLS to {self.address}: {exc.verify_message}",
                                 connect_failed=True) from None
        except (ssl.SSLError, OSError) as exc:
            sock.close()
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"TLS handshake with {self.address} failed: {exc}",
                                 connect_failed=not self.connected_once, closed_unanswered=True) from None

    def drop_idle(self) -> None:
        """Close the idle connections (one was found closed by the node: so are the others)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def give_back(self, sock: socket.socket) -> None:
        """Pool a connection that is between requests (or close it when the pool is full or closed)."""
        with self._lock:
            if not self._closed and len(self._idle) < _MAX_IDLE:
                self._idle.append(sock)
                return
        sock.close()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False

