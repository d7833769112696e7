"""The kvnode's data plane: GET and PUT of whole pages over plain TCP, beside the gRPC
service and on the same PageStore. Framing in kvnode/data_wire.py; Info advertises the port.

Design notes
1. One thread per connection, at most `max_connections`; one over the bound is answered
   RESOURCE_EXHAUSTED and closed (NodeClient then makes that call over gRPC; the answer may be
   lost to a reset when the client's request was not read, and NodeClient treats a new
   connection closed before any reply the same way). Sockets are
   blocking (send and recv release the GIL, and no poll runs before each call, as with a socket
   timeout); kernel timeouts (SO_RCVTIMEO, SO_SNDTIMEO) drop a peer that stalls or idles longer
   than `timeout_s`, and a GET's whole reply must be sent within `timeout_s` (its pages stay
   pinned meanwhile). TCP_NODELAY.
2. GET sends the pages' checksums, then the pages straight from the pool (sendmsg over the
   reply header, the checksums and the pages' slots, no copy in Python), pinned in the store while they are sent so no slot is evicted
   and overwritten mid-send. Measured here, node and client in two processes, 16 pages of
   589,824 bytes: ~0.9-1.06 GB/s pinned against ~0.6 GB/s copying the pages under the store
   lock into a reused buffer first, on a loaded machine: the copy (~2 ms) held the GIL's
   turn and the lock as long as a good part of the send.
3. PUT reads the keys and parents first, then the pages with recv_into into the connection's
   buffer (reused while small, bounded in total: kvnode/recv_buffers.py), checks every page
   as PutPages does, and stores only once the whole request arrived and passed: a request
   cut short stores nothing. Each page keeps the checksum sent with it, unchecked here (the
   readers check it: kvnode/store.py note 8). One outcome per page, as PutPages.
   The bytes of puts being received at once, over all connections, are bounded
   (`max_put_bytes_in_flight`); a put beyond it is refused RESOURCE_EXHAUSTED, unless it is
   the only one (pages of a large model may make one request larger than the bound).
4. A refused request is answered with its status and message, then the connection closes.
   While the rest of the request may still be coming, the server first stops sending and
   reads it away (bounded in bytes and time), so the answer is not lost to a reset.
5. drain() (the node's SIGTERM) stops accepting, closes the connections idle between requests
   at once, and lets the requests being served finish within its timeout, then cuts the rest.
   A request is being served once its header is read and taken under the lock; a header read
   after the drain began is answered UNAVAILABLE (the client goes elsewhere).
6. With `credentials` (protos/security.py) every connection is TLS and the peer must present a
   certificate of the cluster's CA (mutual TLS), as on the node's gRPC port. The handshake runs
   on the connection's thread within `timeout_s`, with the context current at that moment (a
   SIGHUP may have re-read the files). A connection over the bound is closed without an answer
   (no handshake is spent on it); the client sends that call over gRPC. The session runs over
   memory BIOs on the blocking socket (data_wire.TlsStream, its design note 5), which keeps its
   kernel timeouts: each page is encrypted from its slot whole and sent with one sendall (the
   reply's header with the first page, a banded GET's slices ~256 KiB a sendall).
7. GET_BANDS (data_wire design note 6) is a GET whose pages are sent band-major: the same pins
   and deadline, one sendmsg list of (band, page) slices of the pinned slots, cut by send_parts
   into calls of at most IOV_MAX buffers; no copy.
8. With `unix` the same server also listens on a Linux abstract Unix socket under a random name
   (Info advertises it), for clients on the node's host: a stream socket there moved the data
   plane's GETs 1.4-1.6x as fast as TCP over loopback (docs/benchmarks.md). Abstract names
   belong to the network namespace, so whoever reaches it could reach the loopback port already
   (firewall rules on the TCP port do not apply to it; `--no-data-unix` turns it off);
   and its connections are served exactly as TCP ones: the same connection bound (shared),
   kernel timeouts, deadlines and, with `credentials`, the same mutual TLS.
   The name is random, not derived from the port or node id: a predictable name could be bound
   by another local process before the node starts. A node restarted gets a new one, and its
   clients learn it from Info once the old name has nobody listening (data_client.py note 7).
   A name already bound (EADDRINUSE) does not stop the node: one log line, and it serves on TCP
   alone (Info advertises no socket). Once the node exits its name is free, and a process that
   binds it gets the connections of clients still holding the old Info, as one that binds a
   freed TCP port would: without TLS any process here could reach the node's data plane anyway;
   with `credentials` it cannot complete the handshake (the client checks the node's certificate).
9. With `share_pool` and a store whose pool is in shared memory (kvnode/shared_pool.py), a peer
   on the Unix socket may map the pool read-only (MAP_POOL) and fetch pages by their slots
   (GET_SLOTS: data_wire design note 7): a copy at memory speed instead of a socket's two. Only
   where no more is revealed than the peer could read already: a plaintext node (with
   `credentials` the same host goes over TLS on the Unix socket, as a member's certificate is
   the rule there), and a peer process of the node's own user or root (SO_PEERCRED), who may
   read the pages over the socket anyway (and could attach to the node where ptrace is not
   restricted). The pool is sealed against writes (shared_pool note 1): a reader cannot alter a
   page. Pages stay pinned until the peer says it copied them, or
   until `timeout_s` passes and the connection is dropped, as a GET's reply must be sent
   within it.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import ssl
import threading
import time
import uuid

import grpc

from kvnode import data_wire as dw
from kvnode.checksum import CHECKSUM_BYTES
from protos import security
from kvnode import shared_pool
from kvnode.recv_buffers import DEFAULT_KEEP_PER_CONNECTION, DEFAULT_KEEP_TOTAL, BufferBudget, ReceiveBuffer
from kvnode.store import KEY_BYTES, InvalidRequest, PageNotFound, PageStore, PutOutcome

log = logging.getLogger("kvnode")

DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAX_PUT_BYTES_IN_FLIGHT = 512 * 2**20  # PUT pages received at once, over all connections
_DRAIN_LIMIT_BYTES = 512 * 2**20
_DRAIN_TIMEOUT_S = 1.0


class _Dropped(Exception):
    """The peer went away, stalled or cut a request short: close without an answer."""


class _Idle(_Dropped):
    """No request for timeout_s: a pooled client connection, closed quietly (the client reconnects)."""


class DataPlaneServer:
    """Serves GET and PUT on `host:port` (0 picks a free port) until stop()."""

    def __init__(self, store: PageStore, host: str = "127.0.0.1", port: int = 0, max_keys: int = 256,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_put_bytes_in_flight: int = DEFAULT_MAX_PUT_BYTES_IN_FLIGHT,
                 keep_buffer_bytes: int = DEFAULT_KEEP_PER_CONNECTION, max_kept_buffer_bytes: int = DEFAULT_KEEP_TOTAL,
                 credentials=None, unix: bool = False, share_pool: bool = True):
        self.store = store
        self.credentials = credentials  # design note 6
        self.buffers = BufferBudget(keep_buffer_bytes, max_kept_buffer_bytes)
        self.max_keys = max_keys
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.max_put_bytes_in_flight = max_put_bytes_in_flight
        self.metrics = None  # kvnode.metrics.NodeMetrics with --metrics-port: one call per request
        self._put_bytes_in_flight = 0
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host.strip("[]"), port), family=family, backlog=128)
        self._listener.settimeout(0.2)  # the accept loop wakes to see stop()
        self.host, self.port = host, self._listener.getsockname()[1]
        self.unix_name = ""  # the abstract socket's name, without its leading NUL (design note 8)
        self._unix_listener = _unix_listener() if unix else None
        if self._unix_listener is not None:
            self.unix_name = self._unix_listener.getsockname()[1:].decode("ascii")
        # The pool readers on this host may map (design note 9); None: not shared.
        self.shared_pool = (store.shared_pool if share_pool and self._unix_listener is not None and credentials is None
                            else None)
        self.pages_by_slot = 0  # pages readers copied out of the shared pool (GET_SLOTS), since start
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._busy: set[socket.socket] = set()  # connections serving a request (design note 5)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._acceptors = [threading.Thread(target=self._accept_loop, args=(listener,), name="data-plane-accept",
                                            daemon=True)
                           for listener in self._listeners()]

    def _listeners(self) -> list[socket.socket]:
        return [self._listener] + ([self._unix_listener] if self._unix_listener is not None else [])

    def start(self) -> "DataPlaneServer":
        for acceptor in self._acceptors:
            acceptor.start()
        return self

    def put_bytes_in_flight(self) -> int:
        """Bytes of PUT pages being received right now, over all connections."""
        with self._lock:
            return self._put_bytes_in_flight

    def kept_buffer_bytes(self) -> int:
        """Bytes of PUT buffers connections keep between requests, over all connections."""
        return self.buffers.kept_bytes()

    def num_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop accepting, cut every connection, and wait (bounded) for their threads."""
        self._stopping.set()
        for acceptor in self._acceptors:
            acceptor.join(timeout_s)
        for listener in self._listeners():
            listener.close()
        with self._lock:
            connections = dict(self._connections)
        _shutdown(connections)
        deadline = time.monotonic() + timeout_s
        for thread in connections.values():
            thread.join(max(0.0, deadline - time.monotonic()))

    def drain(self, timeout_s: float) -> tuple[int, int]:
        """Stop taking connections and requests, let those being served finish within timeout_s,
        then cut what is left (design note 5); (requests that ended, requests cut)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:  # what is being served is taken as the drain begins, not after the acceptors woke
            self._stopping.set()
            busy = {conn: self._connections[conn] for conn in self._busy if conn in self._connections}
            idle = [conn for conn in self._connections if conn not in busy]
        _shutdown(idle)
        for acceptor in self._acceptors:  # one accepted meanwhile is closed without an answer (_serve sees
            acceptor.join(1.0)            # the drain): its client sends that call over gRPC
        for listener in self._listeners():
            listener.close()
        for thread in busy.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            cut = sum(1 for conn in busy if conn in self._busy)
            left = dict(self._connections)
        _shutdown(left)
        join_by = time.monotonic() + 2.0
        for thread in left.values():
            thread.join(max(0.0, join_by - time.monotonic()))
        return len(busy) - cut, cut

    def __enter__(self) -> "DataPlaneServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- connections -----------------------------------------------------------

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                conn, peer = listener.accept()
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                log.warning("data plane accept failed", exc_info=True)
                time.sleep(0.1)
                continue
            conn.settimeout(None)
            peer = peer or "the unix socket"  # an abstract socket's client has no name
            with self._lock:
                full = len(self._connections) >= self.max_connections
                if not full:
                    thread = threading.Thread(target=self._serve, args=(conn, peer), name="data-plane-conn", daemon=True)
                    self._connections[conn] = thread
            if full and self.credentials is not None:
                log.info("data plane closed a connection from %s: %d connections open", peer, self.max_connections)
                conn.close()  # design note 6
                continue
            if full:
                log.info("data plane refused a connection from %s: %d connections open", peer, self.max_connections)
                self._refuse(conn, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"this node serves at most {self.max_connections} data plane connections: retry later", 0)
                continue
            thread.start()

    def _serve(self, conn: socket.socket, peer) -> None:
        connection = None
        try:
            if self.credentials is not None:
                conn = self._handshake(conn, peer)
                refusal = security.not_member_reason(security.socket_role(conn), ("worker",), "the data plane")
                if refusal is not None:  # protos/security.py note 4
                    raise _Dropped(refusal)
            connection = _Connection(conn, self.timeout_s, ReceiveBuffer(self.buffers))
            while not self._stopping.is_set():
                if not self._serve_one(connection):
                    break
        except _Idle as exc:
            log.debug("data plane closed %s: %s", peer, exc)
        except _Dropped as exc:
            log.info("data plane dropped %s: %s", peer, exc)
        except dw.FrameError as exc:
            log.info("refused data plane request: %s: %s", exc.code.name, exc)
            self._refuse(conn, exc.code, str(exc), connection.pending if connection else 0)
        except ssl.SSLError as exc:
            log.info("data plane dropped %s: %s", peer, exc)
        except OSError as exc:  # e.g. reset before its options could be set
            log.info("data plane dropped %s: %s", peer, exc)
        except Exception:  # a bug here must not take the node down: close this connection only
            log.exception("data plane connection from %s failed", peer)
        finally:
            conn.close()
            if connection is not None:
                connection.buffer.close()
            with self._lock:
                self._connections.pop(conn, None)

    def _handshake(self, conn: socket.socket, peer) -> dw.TlsStream:
        """Mutual TLS on an accepted connection (design note 6); it takes the socket's place."""
        raw = conn
        try:
            dw.set_kernel_timeouts(raw, self.timeout_s)
            conn = dw.TlsStream(raw, self.credentials.server_context(), server_side=True)
        except (ssl.SSLError, OSError) as exc:
            raw.close()
            raise _Dropped(f"TLS handshake failed: {exc}") from None
        finally:
            with self._lock:
                thread = self._connections.pop(raw, None)
                if thread is not None and conn is not raw:
                    self._connections[conn] = thread
        if self._stopping.is_set():
            raise _Dropped("stopping")
        return conn

    def _serve_one(self, connection: "_Connection") -> bool:
        """Serve one request; False when the peer closed the connection between requests."""
        head = connection.receive(dw.REQUEST.size, first=True)
        if head is None:
            return False
        with self._lock:
            stopping = self._stopping.is_set()
            if not stopping:
                self._busy.add(connection.conn)
        if stopping:
            raise dw.FrameError(grpc.StatusCode.UNAVAILABLE, "this node is stopping: send the request elsewhere")
        try:
            return self._serve_request(connection, head)
        finally:
            with self._lock:
                self._busy.discard(connection.conn)

    def _serve_request(self, connection: "_Connection", head) -> bool:
        header = dw.parse_request_header(head)
        connection.pending = self._request_bytes(header)
        if header.key_bytes != KEY_BYTES:
            raise dw.FrameError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"keys must be {KEY_BYTES} bytes, the request says {header.key_bytes}")
        if header.op == dw.OP_MAP_POOL:
            if header.count:
                raise dw.FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"MAP_POOL takes no keys, got {header.count}")
            self._map_pool(connection)
            return True
        if header.count == 0:
            raise dw.FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"{dw.OPS[header.op]} needs at least one key")
        if header.count > self.max_keys:
            raise dw.FrameError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{header.count} keys in one request; this node takes at most {self.max_keys}: "
                                "split the request")
        if header.op in (dw.OP_GET, dw.OP_GET_BANDS):
            self._get(connection, header)
        elif header.op == dw.OP_GET_SLOTS:
            self._get_slots(connection, header)
        else:
            self._put(connection, header)
        connection.pending = 0
        return True

    def _request_bytes(self, header: dw.RequestHeader) -> int:
        """What the peer will still send after this header (for draining after a refusal)."""
        if header.op in (dw.OP_GET, dw.OP_GET_BANDS, dw.OP_GET_SLOTS):
            return header.count * header.key_bytes
        return header.count * (dw.put_entry_bytes(header.key_bytes, header.checksums) + header.page_bytes)

    @staticmethod
    def _receive_keys(connection: "_Connection", header: dw.RequestHeader) -> list[bytes]:
        raw_keys = connection.receive(header.count * KEY_BYTES)
        connection.pending = 0
        return [bytes(raw_keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]) for i in range(header.count)]

    def _get(self, connection: "_Connection", header: dw.RequestHeader) -> None:
        started = time.perf_counter()
        keys = self._receive_keys(connection, header)
        bands = None
        if header.op == dw.OP_GET_BANDS:  # design note 7
            if not header.checksums:
                raise dw.FrameError(grpc.StatusCode.INVALID_ARGUMENT,
                                    "GET_BANDS needs a version 2 request (pages with checksums)")
            bands = dw.band_bounds(self.store.page_bytes, header.page_bytes)
            if len(bands) * header.count > dw.MAX_BAND_SLICES:
                raise dw.FrameError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{header.count} pages in {len(bands)} bands are {len(bands) * header.count} "
                                    f"slices; at most {dw.MAX_BAND_SLICES} a request: ask for fewer pages or "
                                    f"larger bands")
        try:
            pages = self.store.pin_pages(keys)
        except PageNotFound as exc:
            raise dw.FrameError(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        try:
            checksums = self.store.checksums(keys) if header.checksums else []  # pinned: still cached
            payload = header.count * self.store.page_bytes + len(checksums) * CHECKSUM_BYTES
            if bands is not None:
                pages = [memoryview(page).cast("B")[start:end] for start, end in bands for page in pages]
            # The whole reply within timeout_s: a reader that trickles must not hold pins for long.
            connection.send_parts([dw.ok_reply(payload) + b"".join(checksums), *pages],
                                  deadline=time.monotonic() + self.timeout_s)
        finally:
            del pages
            self.store.unpin_pages(keys)
        if self.metrics is not None:
            self.metrics.data_get(header.count * self.store.page_bytes, time.perf_counter() - started)

    def _not_shared_reason(self, conn) -> str | None:
        """Why this peer may not read the shared pool (design note 9); None when it may."""
        if self.shared_pool is None:
            return ("this node does not share its page pool (it runs with TLS, --no-shared-pool or without a unix "
                    "socket, or the platform has no memfd): fetch with GET")
        if getattr(conn, "family", None) != socket.AF_UNIX:
            return "the shared page pool is offered on the node's unix socket only: fetch with GET"
        uid, own = shared_pool.peer_uid(conn), os.geteuid()
        if uid is None or uid not in (own, 0):
            return f"the shared page pool is for processes of the node's user ({own}) only; yours is {uid}: fetch with GET"
        return None

    def _map_pool(self, connection: "_Connection") -> None:
        """MAP_POOL: the pool's sealed descriptor, sent beside the reply (data_wire note 7)."""
        refusal = self._not_shared_reason(connection.conn)
        if refusal is not None:
            raise dw.FrameError(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        pool = self.shared_pool
        connection.send_with_fd(dw.ok_reply(dw.POOL_REPLY.size) + dw.POOL_REPLY.pack(pool.pages, pool.page_bytes),
                                pool.fd)

    def _get_slots(self, connection: "_Connection", header: dw.RequestHeader) -> None:
        """GET_SLOTS: pin the pages, tell their slots (and send the bytes of those without one),
        unpin once the reader says it copied them (data_wire note 7)."""
        started = time.perf_counter()
        keys = self._receive_keys(connection, header)
        refusal = self._not_shared_reason(connection.conn)
        if refusal is not None:
            raise dw.FrameError(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        try:
            slots, views = self.store.pin_slots(keys)
        except PageNotFound as exc:
            raise dw.FrameError(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        try:
            checksums = self.store.checksums(keys)  # pinned: still cached
            table = b"".join(checksum + dw.SLOT.pack(dw.NO_SLOT if slot is None else slot)
                             for checksum, slot in zip(checksums, slots))
            unslotted = [view for slot, view in zip(slots, views) if slot is None]
            payload = len(table) + len(unslotted) * self.store.page_bytes
            connection.send_parts([dw.ok_reply(payload) + table, *unslotted], deadline=time.monotonic() + self.timeout_s)
            answer = connection.receive(len(dw.RELEASE))  # within timeout_s, or the peer is dropped
            if bytes(answer) != dw.RELEASE:
                raise _Dropped(f"sent {bytes(answer)!r} instead of releasing the pages of a GET_SLOTS")
        finally:
            del views
            self.store.unpin_pages(keys)
        with self._lock:
            self.pages_by_slot += len(keys) - len(unslotted)
        if self.metrics is not None:
            self.metrics.data_get(header.count * self.store.page_bytes, time.perf_counter() - started)

    def _put(self, connection: "_Connection", header: dw.RequestHeader) -> None:
        page_bytes = self.store.page_bytes
        if header.page_bytes != page_bytes:
            raise dw.FrameError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"pages of {header.page_bytes} bytes; this node stores pages of {page_bytes} bytes")
        size = header.count * page_bytes
        with self._lock:
            # One request is always taken when no other is being received, however large its pages.
            if self._put_bytes_in_flight and self._put_bytes_in_flight + size > self.max_put_bytes_in_flight:
                raise dw.FrameError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"this node is receiving {self._put_bytes_in_flight} bytes of puts already and "
                                    f"takes {self.max_put_bytes_in_flight} at once; retry later or send fewer pages")
            self._put_bytes_in_flight += size
        try:
            self._receive_and_store(connection, header)
        finally:
            with self._lock:
                self._put_bytes_in_flight -= size

    def _receive_and_store(self, connection: "_Connection", header: dw.RequestHeader) -> None:
        started = time.perf_counter()
        page_bytes = self.store.page_bytes
        entry_block = connection.receive(header.count * dw.put_entry_bytes(KEY_BYTES, header.checksums))
        connection.pending -= len(entry_block)
        entries = dw.parse_put_entries(entry_block, header.count, KEY_BYTES, header.checksums)
        data = connection.receive(header.count * page_bytes, into_buffer=True)
        connection.pending = 0
        pages = [data[i * page_bytes : (i + 1) * page_bytes] for i in range(header.count)]
        try:
            for (key, parent, checksum), page in zip(entries, pages):
                self.store.validate_put(key, parent, page, checksum)
        except InvalidRequest as exc:
            raise dw.FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"{exc}; nothing stored") from None
        outcomes = [self.store.put(key, parent, page, checksum) for (key, parent, checksum), page in zip(entries, pages)]
        refused = sum(1 for o in outcomes if o in (PutOutcome.REFUSED_NO_PARENT, PutOutcome.REFUSED_NO_ROOM))
        if refused:
            log.info("put refused %d of %d pages (no parent or no room)", refused, len(outcomes))
        connection.send(dw.ok_reply(len(outcomes)) + bytes(outcomes))
        if self.metrics is not None:
            self.metrics.data_put(header.count * page_bytes, outcomes, time.perf_counter() - started)

    def _refuse(self, conn: socket.socket, code: grpc.StatusCode, message: str, pending: int) -> None:
        """Answer `code`, then close; first read away up to `pending` bytes the peer may still send."""
        try:
            conn.sendall(dw.error_reply(code, message))
            conn.shutdown(socket.SHUT_WR)
            if pending > 0:
                conn.settimeout(_DRAIN_TIMEOUT_S)
                sink = bytearray(min(pending, 1 << 20))
                left, deadline = min(pending, _DRAIN_LIMIT_BYTES), time.monotonic() + _DRAIN_TIMEOUT_S
                while left > 0 and time.monotonic() < deadline:
                    n = conn.recv_into(sink, min(left, len(sink)))
                    if n == 0:
                        break
                    left -= n
        except OSError:
            pass  # the peer is gone: nothing more to tell it
        finally:
            conn.close()


def _new_unix_name() -> str:
    return "kvcache-data-" + uuid.uuid4().hex


def _unix_listener() -> socket.socket | None:
    """A listening abstract Unix socket under a random name (design note 8), or None where there is none."""
    if not hasattr(socket, "AF_UNIX"):
        return None
    name = _new_unix_name()
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError as exc:  # a sandbox that forbids unix sockets
        log.info("data plane: no unix socket beside TCP (%s)", exc)
        return None
    try:
        listener.bind(b"\0" + name.encode("ascii"))
        listener.listen(128)
    except OSError as exc:
        listener.close()
        if exc.errno == errno.EADDRINUSE:
            log.warning("data plane: the abstract unix socket name @%s is held by another process; serving on TCP "
                        "only (Info advertises no unix socket). `ss -xlp` names its holder", name)
        else:  # not Linux (no abstract names), or a sandbox that forbids them
            log.info("data plane: no unix socket beside TCP (%s)", exc)
        return None
    listener.settimeout(0.2)  # the accept loop wakes to see stop()
    return listener


def _shutdown(connections) -> None:
    for conn in connections:
        try:
            conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv or send
        except OSError:
            pass


class _Connection:
    """One peer's socket and its PUT buffer; blocking I/O with kernel timeouts."""

    def __init__(self, conn: socket.socket, timeout_s: float, buffer: ReceiveBuffer):
        self.conn = conn
        self.timeout_s = timeout_s
        self.pending = 0  # bytes of the current request not yet read
        self.buffer = buffer
        self._small = bytearray(dw.REQUEST.size)
        dw.set_no_delay(conn)
        dw.set_kernel_timeouts(conn, timeout_s)

    def receive(self, size: int, first: bool = False, into_buffer: bool = False) -> memoryview | None:
        """Exactly `size` bytes; None when `first` and the peer closed before sending any."""
        view = self.buffer.view(size) if into_buffer else memoryview(
            self._small if size <= len(self._small) else bytearray(size))[:size]
        got = 0
        while got < size:
            try:
                n = self.conn.recv_into(view[got:])
            except (BlockingIOError, socket.timeout):
                if first and got == 0:
                    raise _Idle("idle for too long") from None
                raise _Dropped(f"stalled after {got} of {size} bytes") from None
            except OSError as exc:
                raise _Dropped(f"connection broke: {exc}") from None
            if n == 0:
                if first and got == 0:
                    return None
                raise _Dropped(f"disconnected after {got} of {size} bytes of a request")
            got += n
        return view

    def send_parts(self, parts: list, deadline: float) -> None:
        try:
            dw.send_parts(self.conn, parts, deadline)
        except (BlockingIOError, socket.timeout):
            raise _Dropped("did not read the reply in time") from None
        except OSError as exc:
            raise _Dropped(f"connection broke while sending: {exc}") from None
        dw.set_kernel_timeouts(self.conn, self.timeout_s)  # send_parts shortened the send timeout

    def send_with_fd(self, data: bytes, fd: int) -> None:
        """`data` with `fd` as SCM_RIGHTS ancillary data (a plain Unix socket only)."""
        self.send(data, fd)

    def send(self, data, fd: int | None = None) -> None:
        try:
            sent = 0 if fd is None else socket.send_fds(self.conn, [data], [fd])
            if sent < len(data):
                self.conn.sendall(memoryview(data)[sent:])
        except (BlockingIOError, socket.timeout):
            raise _Dropped("stopped reading the reply") from None
        except OSError as exc:
            raise _Dropped(f"connection broke while sending: {exc}") from None

