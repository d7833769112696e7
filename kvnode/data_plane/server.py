"""The kvnode's data plane: GET and PUT of whole pages, and LOOKUP, over plain TCP (and on Linux an
abstract Unix socket), beside the gRPC service and on the same PageStore; Info advertises both.
Framing: kvnode/wire/data_frames.py. One connection's I/O and timeouts: connection.py; PUT and the
bound on the bytes of puts in flight: puts.py; the shared pool's MAP_POOL and GET_SLOTS:
shared_pool_serving.py. Why it exists and what it measured: docs/architecture.md, "The data plane".

One thread per connection, on blocking sockets: send and recv release the GIL and no poll runs
before each call; kernel timeouts (SO_RCVTIMEO, SO_SNDTIMEO) drop a peer that stalls or idles
longer than `timeout_s`.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time

import grpc

from base import security
from base.log_limits import CountedEvent
from kvnode.wire import data_frames as dw
from kvnode.wire.checksum import CHECKSUM_BYTES
from kvnode.data_plane.connection import Connection, Dropped, Idle, refuse, shutdown_all, unix_listener
from kvnode.data_plane.puts import DEFAULT_MAX_PUT_BYTES_IN_FLIGHT, PutReceiver
from kvnode.data_plane.recv_buffers import DEFAULT_KEEP_PER_CONNECTION, DEFAULT_KEEP_TOTAL, BufferBudget, ReceiveBuffer
from kvnode.data_plane.shared_pool_serving import send_pool, send_slots
from kvnode.store.page_store import KEY_BYTES, InvalidRequest, LeaseRefused, PageNotFound, PageStore
from kvnode.wire.tls_stream import TlsStream

log = logging.getLogger("kvnode")

DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_TIMEOUT_S = 60.0


class DataPlaneServer:
    """Serves GET, PUT and LOOKUP on `host:port` (0 picks a free port) until stop()."""

    def __init__(self, store: PageStore, host: str = "127.0.0.1", port: int = 0, max_keys: int = 256,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_put_bytes_in_flight: int = DEFAULT_MAX_PUT_BYTES_IN_FLIGHT,
                 keep_buffer_bytes: int = DEFAULT_KEEP_PER_CONNECTION, max_kept_buffer_bytes: int = DEFAULT_KEEP_TOTAL,
                 credentials=None, unix: bool = False, share_pool: bool = True):
        self.store = store
        # With credentials (base/security.py) every connection is mutual TLS, as on the node's gRPC port.
        self.credentials = credentials
        self.buffers = BufferBudget(keep_buffer_bytes, max_kept_buffer_bytes)
        self.max_keys = max_keys
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.puts = PutReceiver(store, max_put_bytes_in_flight)  # bounds the bytes of puts in flight
        self.metrics = None  # kvnode.metrics.NodeMetrics with --metrics-port: one call per request
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host.strip("[]"), port), family=family, backlog=128)
        self._listener.settimeout(0.2)  # the accept loop wakes to see stop()
        self.host, self.port = host, self._listener.getsockname()[1]
        # With `unix`, an abstract Unix socket for clients on this host, faster than loopback TCP and
        # served exactly as TCP (the same connection bound, timeouts and TLS). Its name lives in the
        # network namespace, so whoever reaches it could reach the loopback port already; random, so no
        # local process can bind it before the node (connection.unix_listener). A restarted node has a
        # new name, which clients read from Info once the old one has nobody listening.
        self.unix_name = ""  # the abstract socket's name, without its leading NUL
        self._unix_listener = unix_listener() if unix else None
        if self._unix_listener is not None:
            self.unix_name = self._unix_listener.getsockname()[1:].decode("ascii")
        # The pool readers on this host may map (kvnode/data_plane/shared_pool_serving.py); None: not shared.
        self.shared_pool = (store.shared_pool if share_pool and self._unix_listener is not None and credentials is None
                            else None)
        self.pages_by_slot = 0  # pages readers copied out of the shared pool (GET_SLOTS), since start
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._busy: set[socket.socket] = set()  # connections serving a request (see drain)
        # Connections over max_connections are answered RESOURCE_EXHAUSTED and closed (NodeClient makes
        # that call over gRPC); logged as one line per interval with their count, so a crowd of
        # clients cannot flood the log.
        self._refusals = CountedEvent()
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
        return self.puts.bytes_in_flight()

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
        shutdown_all(connections)
        deadline = time.monotonic() + timeout_s
        for thread in connections.values():
            thread.join(max(0.0, deadline - time.monotonic()))

    def drain(self, timeout_s: float) -> tuple[int, int]:
        """Stop taking connections and requests, let those being served finish within timeout_s,
        then cut what is left; (requests that ended, requests cut). Connections idle between
        requests close at once. A request is being served once its header is read and taken
        under the lock; a header read after the drain began is answered UNAVAILABLE, its rest
        read away first, so the client goes elsewhere."""
        deadline = time.monotonic() + timeout_s
        with self._lock:  # what is being served is taken as the drain begins, not after the acceptors woke
            self._stopping.set()
            busy = {conn: self._connections[conn] for conn in self._busy if conn in self._connections}
            idle = [conn for conn in self._connections if conn not in busy]
        shutdown_all(idle)
        for acceptor in self._acceptors:  # one accepted meanwhile is closed without an answer (_serve sees
            acceptor.join(1.0)            # the drain): its client sends that call over gRPC
        for listener in self._listeners():
            listener.close()
        for thread in busy.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            cut = sum(1 for conn in busy if conn in self._busy)
            left = dict(self._connections)
        shutdown_all(left)
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
            if full:
                self._log_refusal(peer)
            if full and self.credentials is not None:
                conn.close()  # under TLS: closed without an answer, no handshake spent; the client goes to gRPC
                continue
            if full:
                refuse(conn, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"this node serves at most {self.max_connections} data plane connections: retry later", 0)
                continue
            thread.start()

    def _log_refusal(self, peer) -> None:
        self._refusals.happened()
        count = self._refusals.to_log()
        if count:
            how = "closed" if self.credentials is not None else "refused"  # see _accept_loop
            log.info("data plane %s %d connection(s) since the last such line, the last from %s: %d connections open",
                     how, count, peer, self.max_connections)

    def _serve(self, conn: socket.socket, peer) -> None:
        connection = None
        try:
            if self.credentials is not None:
                conn = self._handshake(conn, peer)
                refusal = security.not_member_reason(security.socket_role(conn), ("worker",), "the data plane")
                if refusal is not None:  # only a worker's certificate may read or write pages
                    raise Dropped(refusal)
            connection = Connection(conn, self.timeout_s, ReceiveBuffer(self.buffers))
            while not self._stopping.is_set():
                if not self._serve_one(connection):
                    break
        except Idle as exc:
            log.debug("data plane closed %s: %s", peer, exc)
        except Dropped as exc:
            log.info("data plane dropped %s: %s", peer, exc)
        except dw.FrameError as exc:
            log.info("refused data plane request: %s: %s", exc.code.name, exc)
            refuse(conn, exc.code, str(exc), connection.pending if connection else 0)
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

    def _handshake(self, conn: socket.socket, peer) -> TlsStream:
        """Mutual TLS on an accepted connection; it takes the socket's place. It runs on the
        connection's thread, whole within timeout_s, with the context current at that moment (a
        SIGHUP may have re-read the files), over memory BIOs (TlsStream) so the socket keeps its
        kernel timeouts."""
        raw = conn
        try:
            dw.set_kernel_timeouts(raw, self.timeout_s)
            conn = TlsStream(raw, self.credentials.server_context(), server_side=True,  # the context now:
                             deadline=time.monotonic() + self.timeout_s)  # the whole handshake within timeout_s
        except (ssl.SSLError, OSError) as exc:
            raw.close()
            raise Dropped(f"TLS handshake failed: {exc}") from None
        finally:  # stopping: the entry is not moved, as _serve's finally pops the raw socket's
            with self._lock:
                thread, stopping = self._connections.pop(raw, None), self._stopping.is_set()
                if thread is not None and conn is not raw and not stopping:
                    self._connections[conn] = thread
        if stopping:
            raise Dropped("stopping")
        return conn

    def _serve_one(self, connection: Connection) -> bool:
        """Serve one request; False when the peer closed the connection between requests."""
        head = connection.receive(dw.REQUEST.size, first=True)
        if head is None:
            return False
        with self._lock:
            stopping = self._stopping.is_set()
            if not stopping:
                self._busy.add(connection.conn)
        if stopping:  # the rest of the request is read away before the answer (data_plane/connection.py)
            connection.pending = dw.request_bytes(dw.parse_request_header(head))
            raise dw.FrameError(grpc.StatusCode.UNAVAILABLE, "this node is stopping: send the request elsewhere")
        try:
            return self._serve_request(connection, head)
        finally:
            with self._lock:
                self._busy.discard(connection.conn)

    def _serve_request(self, connection: Connection, head) -> bool:
        header = dw.parse_request_header(head)
        connection.pending = dw.request_bytes(header)
        if header.key_bytes != KEY_BYTES:
            raise dw.FrameError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"keys must be {KEY_BYTES} bytes, the request says {header.key_bytes}")
        if header.op == dw.OP_MAP_POOL:
            if header.count:
                raise dw.FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"MAP_POOL takes no keys, got {header.count}")
            send_pool(connection, self.shared_pool)
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
        elif header.op == dw.OP_LOOKUP:
            self._lookup(connection, header)
        else:
            self.puts.serve(connection, header, self.metrics)
        connection.pending = 0
        return True

    @staticmethod
    def _receive_keys(connection: Connection, header: dw.RequestHeader) -> list[bytes]:
        raw_keys = connection.receive(header.count * KEY_BYTES)
        connection.pending = 0
        return [bytes(raw_keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]) for i in range(header.count)]

    def _get(self, connection: Connection, header: dw.RequestHeader) -> None:
        """GET: the pages' checksums, then the pages straight from their pool slots (sendmsg, no copy in
        Python), pinned while they are sent so no slot is evicted and overwritten mid-send. Copying
        them out under the store's lock instead held the lock, and the GIL, through much of the send."""
        started = time.perf_counter()
        keys = self._receive_keys(connection, header)
        bands = None
        # GET_BANDS is a GET sent band-major: the same pins and deadline, the (band, page) slices of the
        # pinned slots one list for send_parts to cut into sendmsg calls; no copy.
        if header.op == dw.OP_GET_BANDS:
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
            try:
                checksums = self.store.checksums(keys) if header.checksums else []
            except PageNotFound as exc:  # pinned, yet dropped meanwhile (its slots wait for the unpin): as any missing page
                raise dw.FrameError(grpc.StatusCode.NOT_FOUND, str(exc)) from None
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

    def _get_slots(self, connection: Connection, header: dw.RequestHeader) -> None:
        """GET_SLOTS: the pages read out of the shared pool by slot (kvnode/data_plane/shared_pool_serving.py)."""
        started = time.perf_counter()
        keys = self._receive_keys(connection, header)
        by_slot = send_slots(connection, self.store, self.shared_pool, keys, self.timeout_s)
        with self._lock:
            self.pages_by_slot += by_slot
        if self.metrics is not None:
            self.metrics.data_get(header.count * self.store.page_bytes, time.perf_counter() - started)

    def _lookup(self, connection: Connection, header: dw.RequestHeader) -> None:
        """LOOKUP: gRPC's Lookup on the data plane, the same store call and refusals; the hits among
        the keys, leased for lease_ms when > 0. A lookup the leased-pages bound cut short is logged
        as the gRPC path logs it."""
        started = time.perf_counter()
        keys_bytes = header.count * KEY_BYTES
        raw = connection.receive(keys_bytes + dw.LEASE.size)
        connection.pending = 0
        keys = [bytes(raw[i * KEY_BYTES : (i + 1) * KEY_BYTES]) for i in range(header.count)]
        (lease_ms,) = dw.LEASE.unpack_from(raw, keys_bytes)
        try:
            hits, cut = self.store.lookup_and_lease(keys, lease_ms)
        except InvalidRequest as exc:
            raise dw.FrameError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except LeaseRefused as exc:
            raise dw.FrameError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        if cut:
            log.info("lookup cut short: %d hits: this node leases at most %d pages at once and that many are "
                     "leased; later pages were neither leased nor counted", hits, self.store.max_leased_pages)
        connection.send_parts([dw.ok_reply(dw.HITS.size) + dw.HITS.pack(hits)],
                              deadline=time.monotonic() + self.timeout_s)
        if self.metrics is not None:
            self.metrics.data_lookup(time.perf_counter() - started)
