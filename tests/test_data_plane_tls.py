"""The data plane server with TLS (kvnode/data_plane.py note 5), in process: a handshake trickled
a byte at a time ends at timeout_s (kvnode/tls_stream.py note 2), and a connection whose handshake
ends as the node starts stopping leaves no entry in the connection table. The cluster's TLS:
tests/test_security_tls.py."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import pytest

from cluster_helpers import NODE_PAGE_BYTES, wait_for
from kvnode.data_plane import DataPlaneServer
from kvnode.store import PageStore
from kvnode.tls_stream import TlsStream
from protos import security

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
