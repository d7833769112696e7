"""The data plane server with TLS (kvnode/data_plane/server.py), in process: a handshake trickled
a byte at a time ends at timeout_s (a deadline, not a kernel timeout), a request's deadline leaves the
wait for the next request its whole timeout, and a connection whose handshake ends as the node
starts stopping leaves no entry in the connection table. The cluster's TLS:
tests/test_security_tls.py."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import grpc
import pytest

from cluster_helpers import NODE_PAGE_BYTES, wait_for
from data_plane_helpers import put_head
from base import security
from kvnode.wire import data_frames as dw
from kvnode.data_plane.server import DataPlaneServer
from kvnode.store.page_store import PageStore
from kvnode.wire.tls_stream import TlsStream
from store_helpers import key

pytestmark = pytest.mark.usefixtures("no_kvnode_errors_logged")  # a bad peer gets an info line, never an error


def credentials(certs, role: str) -> security.Credentials:
    return security.Credentials(certs / "ca.pem", certs / f"{role}.pem", certs / f"{role}.key")


def test_a_handshake_trickled_a_byte_at_a_time_is_dropped_at_the_timeout(certs, caplog):
    """Each byte comes before a recv times out (timeout_s 0.5); the handshake's deadline drops it."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    with pytest.raises(ssl.SSLWantReadError):
        credentials(certs, "worker").client_context().wrap_bio(incoming, outgoing,
                                                               server_hostname="localhost").do_handshake()
    hello = outgoing.read()
    server = DataPlaneServer(PageStore(4, NODE_PAGE_BYTES), timeout_s=0.5,
                             credentials=credentials(certs, "node")).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5.0) as sock:
            started, dropped_after = time.monotonic(), None
            for byte in hello:
                time.sleep(0.1)
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    pass
                if server.num_connections() == 0:
                    dropped_after = time.monotonic() - started
                    break
            assert dropped_after is not None and dropped_after < 2.0, "the trickled handshake held its connection"
        assert any("TLS handshake failed" in r.getMessage() for r in caplog.records if r.levelname == "INFO")
    finally:
        server.stop()


def test_a_handshake_that_ends_as_the_node_stops_leaves_no_connection_entry(certs):
    """The handshake's connection moves from the raw socket to its TLS stream in the table; one that
    ends after stopping began is dropped, and its entry with it."""
    server = DataPlaneServer(PageStore(4, NODE_PAGE_BYTES), timeout_s=2.0,
                             credentials=credentials(certs, "node")).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5.0) as sock:
            assert wait_for(lambda: server.num_connections() == 1, timeout_s=5.0)  # waiting for the ClientHello
            server._stopping.set()  # what stop() and drain() set first
            thread = threading.Thread(target=TlsStream, args=(sock, credentials(certs, "worker").client_context()),
                                      kwargs={"server_hostname": "localhost"}, daemon=True)
            thread.start()
            thread.join(5.0)
            assert wait_for(lambda: server.num_connections() == 0, timeout_s=3.0), "the connection's entry stayed"
    finally:
        server.stop()


def test_a_tls_request_sent_slowly_leaves_the_next_wait_its_whole_timeout(certs):
    """The request's deadline shortens the receive timeout inside the TLS stream; the wait for the
    next request still has the whole timeout_s (a pooled connection is not dropped early)."""
    server = DataPlaneServer(PageStore(4, NODE_PAGE_BYTES), timeout_s=1.0,
                             credentials=credentials(certs, "node")).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5.0) as sock:
            client = TlsStream(sock, credentials(certs, "worker").client_context(), server_hostname="localhost")

            def receive(size: int) -> bytes:
                data = bytearray(size)
                got = 0
                while got < size:
                    n = client.recv_into(memoryview(data)[got:])
                    assert n, "the node closed the connection"
                    got += n
                return bytes(data)

            def answered() -> grpc.StatusCode:
                code, message_bytes, payload = dw.parse_reply_header(receive(dw.REPLY.size))
                receive(message_bytes + payload)
                return code

            page = bytes(NODE_PAGE_BYTES)
            client.sendall(put_head([key(1)], [b""], data=page))
            client._tls.write(page)  # the page as records whose bytes go in three pieces: the node's
            records = client._outgoing.read()  # stream waits for them in three recvs, ever shorter
            for piece, pause in ((records[:3], 0.05), (records[3:6], 0.7), (records[6:], 0.05)):
                time.sleep(pause)
                sock.sendall(piece)
            assert answered() == grpc.StatusCode.OK  # a PUT's reply sets no timeout back
            time.sleep(0.5)  # idle, under timeout_s
            client.sendall(dw.lookup_request([key(1)], 0))
            assert answered() == grpc.StatusCode.OK
    finally:
        server.stop()
