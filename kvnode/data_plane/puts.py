"""The data plane server's PUT (kvnode/data_plane/server.py): receiving a request's pages, checking them
and storing them, under the bound on the bytes of puts received at once. Apart from the
server because that budget, and the state it keeps, are the PUT path's alone.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from kvnode.wire import data_frames as dw
from kvnode.data_plane.connection import Connection
from kvnode.store.put_refusals import log_refused
from kvnode.store.page_store import KEY_BYTES, InvalidRequest, PageStore

log = logging.getLogger("kvnode")

DEFAULT_MAX_PUT_BYTES_IN_FLIGHT = 512 * 2**20  # PUT pages received at once, over all connections


class PutReceiver:
    """Serves the PUTs of every connection of one server into `store`.

    A PUT's keys and parents come first, then its pages, received with recv_into into the
    connection's buffer (recv_buffers.py); every page is checked as PutPages checks it, and stored
    only once the whole request arrived and passed, so a request cut short stores nothing. Each
    page keeps the checksum sent with it, unchecked here (its readers check it). The bytes received
    at once over all connections are bounded; a put beyond it is refused RESOURCE_EXHAUSTED unless
    it is the only one (a large model's pages may make one request larger than the bound)."""

    def __init__(self, store: PageStore, max_bytes_in_flight: int = DEFAULT_MAX_PUT_BYTES_IN_FLIGHT):
        self.store = store
        self.max_bytes_in_flight = max_bytes_in_flight
        self._bytes_in_flight = 0
        self._lock = threading.Lock()

    def bytes_in_flight(self) -> int:
        """Bytes of PUT pages being received right now, over all connections."""
        with self._lock:
            return self._bytes_in_flight

    def serve(self, connection: Connection, header: dw.RequestHeader, metrics) -> None:
        """One PUT whose header was read; `metrics` (kvnode.metrics.NodeMetrics or None) counts it."""
        page_bytes = self.store.page_bytes
        if header.page_bytes != page_bytes:
            raise dw.FrameError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"pages of {header.page_bytes} bytes; this node stores pages of {page_bytes} bytes")
        size = header.count * page_bytes
        with self._lock:
            # One request is always taken when no other is being received, however large its pages.
            if self._bytes_in_flight and self._bytes_in_flight + size > self.max_bytes_in_flight:
                raise dw.FrameError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"this node is receiving {self._bytes_in_flight} bytes of puts already and "
                                    f"takes {self.max_bytes_in_flight} at once; retry later or send fewer pages")
            self._bytes_in_flight += size
        try:
            self._receive_and_store(connection, header, metrics)
        finally:
            with self._lock:
                self._bytes_in_flight -= size

    def _receive_and_store(self, connection: Connection, header: dw.RequestHeader, metrics) -> None:
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
        log_refused(outcomes)
        connection.send(dw.ok_reply(len(outcomes)) + bytes(outcomes))
        if metrics is not None:
            metrics.data_put(header.count * page_bytes, outcomes, time.perf_counter() - started)
