"""The client side of a kvnode's data plane (framing in kvnode/data_wire.py): GET into the
caller's buffer with recv_into, PUT straight from the caller's pages. NodeClient uses it;
nothing else should.

Design notes
1. A small pool of connections, safe to share between threads: a call takes an idle
   connection (or opens one) and gives it back once its reply was read in full; any
   failure closes it instead.
2. Sockets are blocking with kernel timeouts set to what is left of the call's deadline
   (no poll before each recv); the deadline is also checked after every recv.
3. A pooled connection may have been closed by the node while idle: a call that fails on
   a reused connection before any byte of its reply arrived is sent once more on a new
   connection (GET and PUT are both idempotent), and the other idle connections, closed by
   the node alike, are dropped.
4. Several GETs can share one connection's round trip (`get_batches`): every request is sent
   before the first reply is read, and the node, which reads a connection's requests one at a
   time, answers them in order without waiting for us. Across hosts each request asked after
   the previous reply would cost a round trip of its own (one per batch of a fetch).
5. TLS runs over memory BIOs on the plain socket (data_wire.TlsStream, its design note 5), not
   an ssl.SSLSocket: one recv takes up to a MiB of records, each decrypted into the caller's
   buffer, and the socket keeps its kernel timeouts (note 2). The context, and so the
   certificate checks and the certificate we present, are the same as wrap_socket's.
6. `get_bands` receives a GET_BANDS reply (data_wire design note 6) into one buffer per page,
   band by band, and calls back after each band: the caller may use band b of every page while
   the later bands are on the way.
7. Same host (data_plane design note 7): given the node's abstract Unix socket name and a host
   that is a loopback address, connections go to that socket, 1.4-1.6x as fast as TCP over
   loopback here; both live in the network namespace, so reaching one means reaching the other.
   A name nobody listens on (ECONNREFUSED, ENOENT: the node exited or restarted under a new name,
   or lives in another namespace behind a forwarded port) puts the client on TCP for good, with one
   log line, and sets `unix_gone`: NodeClient then reads Info again before its next data plane
   call, and a node that restarted gives its new name (client.py). Any other failure to connect
   (EAGAIN from a full backlog, say) sends only that connection over TCP; the next one tries the
   socket again. A process that may not make Unix sockets at all (a sandbox) uses TCP for good.
   Everything else is as over TCP: TLS, kernel timeouts, deadlines, the pool.
8. Over the Unix socket of a plaintext node the client maps the node's page pool read-only
   (kvnode/shared_pool.py; shared_pool_serving.py note 1) and fetches by slot: GET_SLOTS pins the
   pages and tells where they are, the client copies them out of the mapping and releases them
   (data_wire design note 7); a page the node has on disk only comes by GET after. The mapping
   is made by a thread of its own, started by the first call (or NodeClient.prepare_data_plane),
   so no request waits for it; until it is there, pages come over the socket as before: for good
   once the node refused it (TLS, another user, --no-shared-pool, a node before the op) or its
   descriptor was not sealed as shared_pool note 1 says, else (a busy socket, a timeout) the
   mapping is tried again after _MAP_RETRY_S. Each batch costs a round trip of its own (the
   request, then the release). The caller checks the checksums as always. A socket name found
   gone drops the mapping with it.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import ssl
import threading
import time
from typing import Callable, Sequence

import grpc
import numpy as np

from kvnode import data_wire as dw
from kvnode import shared_pool
from kvnode.checksum import CHECKSUM_BYTES

_MAX_IDLE = 4
_MAP_TIMEOUT_S = 30.0  # the shared pool's mapping (design note 8), on its own thread
_MAP_RETRY_S = 30.0  # after a mapping failed for a reason that may pass (a busy socket, a timeout)
_MAX_MESSAGE_BYTES = 64 << 10  # of a node's error message read
_SLOT_ENTRY = CHECKSUM_BYTES + dw.SLOT.size
_UNIX_GONE = (errno.ECONNREFUSED, errno.ENOENT)  # nobody listens on the name: the node exited or restarted
_UNIX_FORBIDDEN = (errno.EAFNOSUPPORT, errno.EPERM, errno.EACCES)  # no unix socket can be made here

log = logging.getLogger("kvnode.client")


class DataPlaneError(Exception):
    """`code` is a grpc.StatusCode; `connect_failed` says no connection could be opened at all;
    `closed_unanswered` that a new connection was closed (or reset) before any byte of a reply,
    which is how a refusal of a node at its connection limit can arrive: its answer is lost when
    it closes before reading our request (the kernel then resets the connection)."""

    def __init__(self, code: grpc.StatusCode, details: str, connect_failed: bool = False,
                 closed_unanswered: bool = False):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.connect_failed = connect_failed
        self.closed_unanswered = closed_unanswered


class _Retry(Exception):
    pass


class DataPlaneClient:
    """`tls`: an ssl client context (protos.security.Credentials.client_context): every connection
    is TLS, checked against the node's certificate, and presents ours (mutual TLS). `unix_name`:
    the node's abstract Unix socket, used when `host` is a loopback address (design note 7);
    `shared_memory=False` never maps the node's pool (design note 8)."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None = None, unix_name: str = "",
                 shared_memory: bool = True):
        self.host, self.port = host, port
        self.tls = tls
        self.offered_unix = unix_name
        self.unix_name = unix_name if unix_name and _is_loopback(host) else ""
        self.unix_gone = False  # the node's unix socket name had nobody listening (design note 7)
        self._told_unix_busy = False
        self.connected_once = False
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        # The node's pool, mapped read-only (design note 8): "unasked", "mapping", "mapped" or "refused".
        self.pool_state = "unasked" if shared_memory and self.unix_name and tls is None else "refused"
        self._pool: np.ndarray | None = None
        self._mapping_done = threading.Event()  # a new one each time a mapping is begun
        self._map_again_at = 0.0

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
        """GETs of several batches of keys on one connection, all sent at once (design note 4).
        out_for(i) gives (pages, checksums), where batch i's pages (one buffer, or a list of one a
        page) and their checksums (16 bytes each) are received; it is asked once that batch's reply
        began (it may wait until that memory is free). landed(i) is called once both arrived, in
        order; the caller checks them."""
        requests = [dw.get_request(keys) for keys in batches]

        def exchange(sock: socket.socket, deadline: float, reused: bool) -> None:
            pool = self._pool_for(sock)
            if pool is not None:  # design note 8: one batch at a time, each copied out of the pool
                for number, keys in enumerate(batches):
                    self._copy_pages(sock, pool, keys, lambda: _page_arrays(out_for(number), len(keys)), deadline,
                                     reused and number == 0)
                    landed(number)
                return
            self._send(sock, requests, deadline, reused)
            for number in range(len(batches)):
                payload = self._reply_header(sock, deadline, reused and number == 0)
                out, checksums = out_for(number)
                if checksums.nbytes != len(batches[number]) * CHECKSUM_BYTES:
                    raise ValueError(f"batch {number}: room for {checksums.nbytes} bytes of checksums, expected "
                                     f"{len(batches[number]) * CHECKSUM_BYTES} ({CHECKSUM_BYTES} a page)")
                size = sum(page.nbytes for page in out) if isinstance(out, list) else out.nbytes
                if payload != checksums.nbytes + size:
                    raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"node answers {payload} bytes to batch {number}, "
                                         f"expected {checksums.nbytes + size} (checksums and pages)")
                _receive(sock, checksums, deadline)  # a version 2 reply: the checksums, then the pages
                if isinstance(out, list):
                    _receive_scattered(sock, out, deadline)
                else:
                    _receive(sock, out, deadline)
                landed(number)

        self._call(exchange, timeout_s)

    def get_bands(self, keys: Sequence[bytes], outs: Sequence[memoryview], checksums: memoryview, band_bytes: int,
                  landed: Callable[[int], None], timeout_s: float) -> None:
        """The pages of `keys` in bands of band_bytes (design note 6): page i into outs[i] (each
        page_bytes long), the checksums into `checksums` (16 bytes a page) before any band, then
        landed(b) once band b of every page arrived; the caller checks the checksums. A band size
        the node refuses raises DataPlaneError(INVALID_ARGUMENT); so does a node that predates the op
        (data_wire.is_unknown_op tells that one)."""
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
            pool = self._pool_for(sock)
            if pool is not None:  # design note 8: whole pages out of the pool, then every band at once
                self._copy_pages(sock, pool, keys, lambda: ([np.frombuffer(out, dtype=np.uint8) for out in outs],
                                                            checksums), deadline, reused)
                for band in range(len(bands)):
                    landed(band)
                return
            self._send(sock, [request], deadline, reused)
            payload = self._reply_header(sock, deadline, reused)
            if payload != checksums.nbytes + len(keys) * page_bytes:
                raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"node answers {payload} bytes, expected "
                                     f"{checksums.nbytes + len(keys) * page_bytes} (checksums and pages)")
            _receive(sock, checksums, deadline)
            for band, (start, end) in enumerate(bands):
                _receive_scattered(sock, [out[start:end] for out in outs], deadline)
                landed(band)

        self._call(exchange, timeout_s)

    def put(self, keys: Sequence[bytes], parents: Sequence[bytes], checksums: Sequence[bytes],
            pages: Sequence[memoryview], page_bytes: int, timeout_s: float) -> list[int]:
        """Store pages with their checksums; one PutOutcome value per page."""
        head = dw.put_request_head(keys, parents, checksums, page_bytes)

        def exchange(sock: socket.socket, deadline: float, reused: bool) -> list[int]:
            self._send(sock, [head, *pages], deadline, reused)
            count = self._reply_header(sock, deadline, reused)
            if count != len(keys):
                raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"node answers {count} outcomes for {len(keys)} pages")
            outcomes = memoryview(bytearray(count))
            _receive(sock, outcomes, deadline)
            return list(outcomes)

        return self._call(exchange, timeout_s)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._pool = None  # the mapping goes with the last array that uses it
        self._drop_idle()

    # ---- the shared pool (design note 8) -------------------------------------------

    def map_pool(self, timeout_s: float = _MAP_TIMEOUT_S) -> bool:
        """Map the node's pool now, on this thread (or wait for the thread mapping it), unless it
        was refused; whether it is mapped."""
        if self._claim_mapping():
            self._map_pool(timeout_s)
        elif self.pool_state == "mapping":
            self._mapping_done.wait(timeout_s)
        return self.pool_state == "mapped"

    def start_mapping(self) -> None:
        """Map the node's pool on a thread of its own, unless asked already (design note 8)."""
        if self._claim_mapping():
            threading.Thread(target=self._map_pool, args=(_MAP_TIMEOUT_S,), name="kvnode-pool-map",
                             daemon=True).start()

    def _claim_mapping(self) -> bool:
        with self._lock:
            if self.pool_state != "unasked" or self._closed or time.monotonic() < self._map_again_at:
                return False
            self.pool_state, self._mapping_done = "mapping", threading.Event()
            return True

    def _map_pool(self, timeout_s: float) -> None:
        """MAP_POOL on a new connection to the Unix socket: the pool mapped; refused for good when
        the node or its descriptor says no (design note 8); else asked again after _MAP_RETRY_S."""
        pool, why, for_good, sock = None, "", False, None
        deadline = time.monotonic() + timeout_s
        try:
            sock = self._connect_unix(deadline)
            if sock is None:
                why = "its unix socket did not take the connection"
            else:
                sock.settimeout(None)
                dw.set_kernel_timeouts(sock, max(0.001, deadline - time.monotonic()))
                uid = shared_pool.peer_uid(sock)
                if uid not in (os.geteuid(), 0):  # shared_pool note 2: not the node's socket, or not ours to trust
                    why, for_good = f"the process on its unix socket runs as user {uid}, not as this one or root", True
                else:
                    sock.sendall(dw.request_header(dw.OP_MAP_POOL, 0))
                    pool = self._receive_pool(sock, deadline)
        except DataPlaneError as exc:  # FAILED_PRECONDITION: not offered; INVALID_ARGUMENT: a node before the op
            why = f"{exc.code.name}: {exc.details}"
            for_good = exc.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
        except ValueError as exc:  # a descriptor not sealed or sized as promised
            why, for_good = str(exc), True
        except Exception as exc:  # OSError, MemoryError, ...: this try only
            why = str(exc) or repr(exc)
        with self._lock:
            if pool is not None and not self._closed:
                self._pool, self.pool_state = pool, "mapped"
            else:
                pool = None
                self.pool_state = "refused" if for_good else "unasked"
                self._map_again_at = time.monotonic() + _MAP_RETRY_S
            self._mapping_done.set()
        if pool is None:
            log.info("kvnode data plane %s: pages come over the socket, not out of the node's shared pool (%s)%s",
                     self.address, why, "" if for_good else f"; asked again in {_MAP_RETRY_S:.0f} s")
        if sock is not None:
            if pool is not None:
                self._give_back(sock)
            else:
                sock.close()

    def _receive_pool(self, sock: socket.socket, deadline: float) -> np.ndarray:
        """The MAP_POOL reply: its descriptor mapped (shared_pool.map_read_only), or the node's status raised."""
        data, fds, _, _ = socket.recv_fds(sock, dw.REPLY.size, 1, getattr(socket, "MSG_CMSG_CLOEXEC", 0))
        try:
            if not data:
                raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, "connection closed before a reply")
            header = memoryview(bytearray(dw.REPLY.size))
            header[: len(data)] = data
            _receive(sock, header[len(data):], deadline)
            payload = self._payload_or_status(sock, header, deadline)
            if payload != dw.POOL_REPLY.size or len(fds) != 1:
                raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"a MAP_POOL reply of {payload} bytes and {len(fds)} "
                                     "descriptors is not one this client reads")
            body = memoryview(bytearray(dw.POOL_REPLY.size))
            _receive(sock, body, deadline)
            return shared_pool.map_read_only(fds[0], *dw.POOL_REPLY.unpack(body))
        finally:
            for fd in fds:
                os.close(fd)

    def _pool_for(self, sock) -> np.ndarray | None:
        """The mapped pool when this connection can fetch out of it (a plain Unix one), else None."""
        pool = self._pool
        return pool if pool is not None and getattr(sock, "family", None) == socket.AF_UNIX else None

    def _copy_pages(self, sock: socket.socket, pool: np.ndarray, keys: Sequence[bytes],
                    destination: Callable[[], tuple[list[np.ndarray] | np.ndarray, memoryview]],
                    deadline: float, reused: bool) -> None:
        """GET_SLOTS (data_wire note 7): destination() gives (pages, checksums) once the node
        answered, as out_for does for a GET; page i is copied out of the pool into pages[i] (or
        received, when the node has it in no slot) and its checksum into `checksums`; then the
        pages are released."""
        self._send(sock, [dw.get_request(keys, dw.OP_GET_SLOTS)], deadline, reused)
        payload = self._reply_header(sock, deadline, reused)
        table = memoryview(bytearray(len(keys) * _SLOT_ENTRY))
        if payload < table.nbytes:
            raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"node answers {payload} bytes to a GET_SLOTS of "
                                 f"{len(keys)} pages, expected at least {table.nbytes}")
        _receive(sock, table, deadline)
        slots = [dw.SLOT.unpack_from(table, i * _SLOT_ENTRY + CHECKSUM_BYTES)[0] for i in range(len(keys))]
        unslotted = [i for i, slot in enumerate(slots) if slot == dw.NO_SLOT]
        page_bytes = pool.shape[1]
        if payload != table.nbytes + len(unslotted) * page_bytes or \
                any(slot >= len(pool) for slot in slots if slot != dw.NO_SLOT):
            raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"node answers a GET_SLOTS of {len(keys)} pages with "
                                 f"{payload} bytes, naming slots {sorted(set(slots) - {dw.NO_SLOT})} of a pool of "
                                 f"{len(pool)}: not one this client reads")
        pages, checksums = destination()
        if any(page.nbytes != page_bytes for page in pages):
            raise DataPlaneError(grpc.StatusCode.DATA_LOSS, f"the node's shared pool holds pages of {page_bytes} "
                                 f"bytes, the caller's of {pages[0].nbytes}")
        for i in range(len(keys)):
            checksums[i * CHECKSUM_BYTES : (i + 1) * CHECKSUM_BYTES] = table[i * _SLOT_ENTRY :
                                                                             i * _SLOT_ENTRY + CHECKSUM_BYTES]
        if unslotted:
            _receive_scattered(sock, [memoryview(pages[i]) for i in unslotted], deadline)
        for page, slot in zip(pages, slots):
            if slot != dw.NO_SLOT:
                np.copyto(page, pool[slot])
        try:
            sock.sendall(dw.RELEASE)
        except OSError as exc:  # the node unpins them as the connection goes
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"connection broke before the release: {exc}") from None

    # ---- plumbing ----------------------------------------------------------------

    def _call(self, exchange, timeout_s: float):
        if self.pool_state == "unasked":
            self.start_mapping()  # design note 8
        deadline = time.monotonic() + timeout_s
        for attempt in range(2):
            sock, reused = self._take(deadline, fresh=attempt > 0)
            try:
                dw.set_kernel_timeouts(sock, max(0.001, deadline - time.monotonic()))
                result = exchange(sock, deadline, reused and attempt == 0)
            except _Retry:
                sock.close()
                self._drop_idle()  # the node closed idle connections: the others are as stale
                continue
            except BaseException:
                sock.close()
                raise
            self._give_back(sock)
            return result
        raise AssertionError("a retried data plane call asked for another retry")

    def _take(self, deadline: float, fresh: bool = False) -> tuple[socket.socket, bool]:
        with self._lock:
            if self._idle and not fresh:
                return self._idle.pop(), True
        sock = self._connect_unix(deadline) if self.unix_name else None
        if sock is None:
            sock = self._connect_tcp(deadline)
        sock.settimeout(None)  # blocking; deadlines come from kernel timeouts (note 2)
        dw.set_no_delay(sock)
        if self.tls is not None:
            sock = self._handshake(sock, deadline)
        self.connected_once = True
        return sock, False

    @property
    def transport(self) -> str:
        """"shared memory" once the node's pool is mapped (design note 8), "unix" while the node's
        Unix socket is used (design note 7), else "tcp"."""
        if self.unix_name and self._pool is not None:
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
                self._pool = None  # a gone node's memory is freed once no reader maps it (shared_pool note 2)
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

    def _handshake(self, sock: socket.socket, deadline: float) -> dw.TlsStream:
        """TLS on a new connection. A node that closes it unanswered (at its connection limit) or
        whose certificate fails makes a DataPlaneError; never connected before, `connect_failed`."""
        try:
            dw.set_kernel_timeouts(sock, max(0.001, deadline - time.monotonic()))
            return dw.TlsStream(sock, self.tls, server_hostname=self.host)
        except ssl.SSLCertVerificationError as exc:
            sock.close()
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"TLS to {self.address}: {exc.verify_message}",
                                 connect_failed=True) from None
        except (ssl.SSLError, OSError) as exc:
            sock.close()
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"TLS handshake with {self.address} failed: {exc}",
                                 connect_failed=not self.connected_once, closed_unanswered=True) from None

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < _MAX_IDLE:
                self._idle.append(sock)
                return
        sock.close()

    def _send(self, sock: socket.socket, parts: list, deadline: float, reused: bool) -> None:
        try:
            dw.send_parts(sock, parts, deadline)
        except (BlockingIOError, socket.timeout):
            raise DataPlaneError(grpc.StatusCode.DEADLINE_EXCEEDED, "sending the request timed out") from None
        except OSError as exc:
            # The node may have refused early and closed: its answer says why, if it arrived.
            self._reply_header(sock, deadline, reused, broken=exc)

    def _reply_header(self, sock: socket.socket, deadline: float, reused: bool, broken: OSError | None = None) -> int:
        """The payload length of an OK reply; raises the node's status otherwise."""
        header = memoryview(bytearray(dw.REPLY.size))
        try:
            _receive(sock, header, deadline, first=True)
        except _NothingReceived as exc:
            if reused:
                raise _Retry() from None  # an idle connection the node had closed (note 3)
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE,
                                 f"connection to {self.address} closed before a reply: {broken or exc}",
                                 closed_unanswered=True) from None
        if broken is not None and dw.parse_reply_header(header)[0] == grpc.StatusCode.OK:
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"connection broke while sending: {broken}")
        return self._payload_or_status(sock, header, deadline)

    @staticmethod
    def _payload_or_status(sock: socket.socket, header, deadline: float) -> int:
        """An OK reply header's payload length; else the node's status and message, raised."""
        code, message_bytes, payload = dw.parse_reply_header(header)
        if code == grpc.StatusCode.OK:
            return payload
        message = memoryview(bytearray(min(message_bytes, _MAX_MESSAGE_BYTES)))
        try:
            _receive(sock, message, deadline)
            details = bytes(message).decode("utf-8", errors="replace")
        except DataPlaneError:
            details = "(the node's message was cut off)"
        raise DataPlaneError(code, details)


def _page_arrays(destination: tuple, count: int) -> tuple[list[np.ndarray] | np.ndarray, memoryview]:
    """out_for's (pages, checksums) with the pages as `count` uint8 arrays, one a page."""
    out, checksums = destination
    if isinstance(out, list):
        return [np.frombuffer(page, dtype=np.uint8) for page in out], checksums
    return np.frombuffer(out, dtype=np.uint8).reshape(count, -1), checksums


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _receive_scattered(sock, views: list[memoryview], deadline: float) -> None:
    """Fill `views` in order from `sock`: a plain socket scatters each recv over many of them
    (recvmsg_into), so a band of many pages costs a few calls, not one a page (design note 6)."""
    if not hasattr(sock, "recvmsg_into"):  # a TlsStream decrypts into one buffer at a time
        for view in views:
            _receive(sock, view, deadline)
        return
    first, total = 0, sum(view.nbytes for view in views)
    views, got = list(views), 0
    while first < len(views):
        try:
            n = sock.recvmsg_into(views[first : first + dw.IOV_BATCH])[0]
        except (BlockingIOError, socket.timeout):
            raise DataPlaneError(grpc.StatusCode.DEADLINE_EXCEEDED, f"timed out after {got} of {total} bytes") from None
        except OSError as exc:
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE,
                                 f"connection broke after {got} of {total} bytes: {exc}") from None
        if n == 0:
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"connection closed after {got} of {total} bytes")
        got += n
        while first < len(views) and n >= views[first].nbytes:
            n -= views[first].nbytes
            first += 1
        if n:
            views[first] = views[first][n:]
        if first < len(views) and time.monotonic() > deadline:
            raise DataPlaneError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed after {got} of {total} bytes")


class _NothingReceived(DataPlaneError):
    pass


def _receive(sock: socket.socket, view: memoryview, deadline: float, first: bool = False) -> None:
    """Fill `view` from `sock`; _NothingReceived when `first` and the peer closed before any byte."""
    got, size = 0, view.nbytes
    while got < size:
        try:
            n = sock.recv_into(view[got:])
        except (BlockingIOError, socket.timeout):
            raise DataPlaneError(grpc.StatusCode.DEADLINE_EXCEEDED, f"timed out after {got} of {size} bytes") from None
        except OSError as exc:
            if first and got == 0:
                raise _NothingReceived(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"connection broke after {got} of {size} bytes: {exc}") from None
        if n == 0:
            if first and got == 0:
                raise _NothingReceived(grpc.StatusCode.UNAVAILABLE, "closed by the node")
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"connection closed after {got} of {size} bytes")
        got += n
        if got < size and time.monotonic() > deadline:
            raise DataPlaneError(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed after {got} of {size} bytes")
